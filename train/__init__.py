"""The training side: pack planner, loader, Megatron model and trainer, HF conversion.

Importing any of it first quiets notices that come from the stack as designed, not from
anything a user can act on: megatron-core's, once per module at import, that Transformer
Engine and Apex are absent (it uses its torch fallbacks, the setup this trainer is built for),
and that its GroupedMLP (whose parameters our MoE experts use, see `train.model.moe`) will
give way to TE's, and, once per decoder layer it builds, that the layer's MLP is of a type it
does not know (ours, built with the keywords it passes any module); and torch's, that a CUDA
build of torch found no CUDA runtime (a CPU run of a GPU build).
"""

import logging
import warnings

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed", category=UserWarning)
warnings.filterwarnings("ignore", message="The legacy GroupedMLP will be deprecated", category=UserWarning)
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(
    lambda record: not record.getMessage().startswith("Unknown MLP type"))
