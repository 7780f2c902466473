"""Runnable examples; `python -m slipstream.examples.gpt` is the README's main job."""
