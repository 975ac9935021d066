"""Supervised fine-tuning on the RL trainer and spec: `python -m molt.sft +experiment=NAME`."""
