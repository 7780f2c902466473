"""Roads onto Slipstream from Hugging Face Transformers and Accelerate, and PyTorch Lightning.

Each module imports its framework lazily and only when used (`slipstream.integrations.transformers`,
`.accelerate`, `.lightning`); see docs/integrations.md.
"""
