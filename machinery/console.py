"""The libraries' known-harmless warnings dropped at their source, one logger and exact message each (no library
drops another's: test_console).
"""
import logging
import os
import sys
import warnings


def quiet_vllm():
    """vLLM at WARNING (its INFO lines bury the progress bar), harmless warnings dropped; before importing vllm."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    drop_harmless_warnings()


# vLLM's warnings at every engine start that nobody can act on: logger name -> its exact messages.
SKIPPED_THREADS = "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it."
HARMLESS_VLLM_WARNINGS = {
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend. Disabling Triton.",),
    "vllm.platforms.cpu": ("Triton is not installed. triton-cpu is expected on x86 CPUs.",
                           "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'."),
    "vllm.config.vllm": ("Model Runner V2 requires Triton; using the V1 model runner instead.",
                         "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup. This is "
                         "equivalent to setting -cc.mode=none -cc.cudagraph_mode=none and "
                         "--kernel_config.enable_jit_warmup=False",
                         "Inductor compilation was disabled by user settings, optimizations settings that are only "
                         "active during inductor compilation will be ignored."),
    "vllm.engine.arg_utils": ("This model does not officially support disabling chunked prefill. Disabling this "
                              "manually may cause the engine to crash or produce incorrect outputs.",),
    "vllm.v1.worker.cpu_worker": (*(f"{lib} is not found in LD_PRELOAD. For best performance, please follow the "
                                    "section `set LD_PRELOAD` in https://docs.vllm.ai/en/latest/getting_started/"
                                    "installation/cpu/ to setup required pre-loaded libraries."
                                    for lib in ("libtcmalloc", "libiomp")),
                                  SKIPPED_THREADS),  # only when vLLM's own thread helpers asked: _vllm_own_threads
    # every push: rotary layers hold a cos/sin cache but no weights, and vLLM puts the cache back by itself
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",),
}


def _vllm_own_threads():
    """Whether the refused torch.set_num_threads came from vLLM's own helpers: any other caller's still warns."""
    frame = sys._getframe()
    while frame is not None and frame.f_code.co_name != "skip_set_num_threads":
        frame = frame.f_back
    caller = frame.f_back if frame is not None else None
    return caller is not None and caller.f_code.co_filename.endswith(os.path.join("vllm", "utils", "torch_utils.py"))


class HarmlessWarnings(logging.Filter):

    def __init__(self, messages):
        super().__init__()
        self.messages = frozenset(messages)

    def filter(self, record):
        message = record.getMessage()
        return (record.levelno > logging.WARNING or message not in self.messages
                or (message == SKIPPED_THREADS and not _vllm_own_threads()))


def drop_harmless_warnings():
    """Filters for HARMLESS_VLLM_WARNINGS, and for the FutureWarning vLLM raises by looking at a deprecated name."""
    for name, messages in HARMLESS_VLLM_WARNINGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, HarmlessWarnings) for f in logger.filters):
            logger.addFilter(HarmlessWarnings(messages))
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated",
                            category=FutureWarning, module=r"vllm\.triton_utils\.dispatcher")
