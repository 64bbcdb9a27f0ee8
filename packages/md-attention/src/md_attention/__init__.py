"""md-attention: one attention entry point for md, with local and sequence-parallel implementations."""

from md_attention._attention import attention
from md_attention._config import ACTIVATION_AXES, IMPLEMENTATIONS, AttentionConfig
from md_attention._cudnn import cudnn_attention
from md_attention._select import select_implementation
from md_attention._splash import splash_attention
from md_attention._tuner import cache_key, tune_block_sizes

__all__ = [
  "ACTIVATION_AXES",
  "IMPLEMENTATIONS",
  "AttentionConfig",
  "attention",
  "cache_key",
  "cudnn_attention",
  "select_implementation",
  "splash_attention",
  "tune_block_sizes",
]
