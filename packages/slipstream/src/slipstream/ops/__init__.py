"""DeepSpeed's ``deepspeed.ops`` optimizers, over :mod:`slipstream.kernels.optim`.

>>> from slipstream.ops.adam import DeepSpeedCPUAdam, FusedAdam
"""
