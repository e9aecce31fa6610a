"""moe-lc: pretraining hybrid linear/softmax-attention MoE language models at million-token context."""

__version__ = "0.1.0"
