"""Every shipped config validates; the llama sizes refuse unknown names."""
import os
import sys

import pytest

from gnmr_jax.config import validate_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "configs"))
import llama  # noqa: E402
import small  # noqa: E402
import tiny  # noqa: E402


@pytest.mark.parametrize("module,arg", [(tiny, None), (tiny, "runlocal"), (small, None),
                                        (small, "runlocal")] + [(llama, s) for s in llama.PAPER_SIZES])
def test_config_validates(module, arg):
  config = module.get_config(arg)
  validate_config(config, device_count=8)
  assert config.data.seq_len <= config.model.max_seq_len


def test_llama_unknown_size():
  with pytest.raises(ValueError, match="60m"):
    llama.get_config("70m")
