"""The quiet console (machinery/console.py): vLLM's known-harmless warnings are dropped, each on its own logger and
by its exact message, and every other warning of the same loggers still shows (no engine: the filters driven
directly).

    .venv/bin/python -m pytest tests/test_console.py -q
"""
import torch


class _Shown:
    """The messages a logger passes on to its handlers (its filters ran) while in the with block."""

    def __init__(self, logger):
        import logging
        self.logger, self.messages, self.handler = logger, [], logging.Handler()
        self.handler.emit = lambda record: self.messages.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self.handler)
        return self.messages

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)


def test_vllms_known_harmless_warnings_are_dropped_and_other_warnings_of_their_loggers_show():
    import logging
    from machinery.console import HARMLESS_VLLM_WARNINGS, SKIPPED_THREADS, HarmlessWarnings, drop_harmless_warnings
    drop_harmless_warnings()
    drop_harmless_warnings()  # once per process: a second call adds nothing
    for name, messages in HARMLESS_VLLM_WARNINGS.items():
        logger = logging.getLogger(name)
        assert sum(isinstance(f, HarmlessWarnings) for f in logger.filters) == 1
        others = ["something else went wrong", messages[0] + " And more.", messages[0][:-1]]  # exact text only
        with _Shown(logger) as shown:
            for message in [*messages, *others]:
                logger.warning("%s", message)
        assert shown == [*([SKIPPED_THREADS] if SKIPPED_THREADS in messages else []), *others], name
        with _Shown(logger) as shown:
            logger.error("%s", messages[0])  # the same text as an error: shown
        assert shown == [messages[0]]
    with _Shown(logging.getLogger("vllm.v1.worker.gpu_worker")) as shown:  # another logger: untouched
        logging.getLogger("vllm.v1.worker.gpu_worker").warning(HARMLESS_VLLM_WARNINGS["vllm.config.vllm"][0])
    assert len(shown) == 1


def test_a_refused_set_num_threads_is_dropped_only_when_vllms_own_helper_asked(monkeypatch):
    """vLLM's CPU worker swaps torch.set_num_threads for skip_set_num_threads, a warning: vLLM's own helper
    (vllm/utils/torch_utils.py) calling it is dropped, a call from anywhere else (it had no effect) still shows."""
    import logging
    from machinery.console import SKIPPED_THREADS, drop_harmless_warnings
    from vllm.utils.torch_utils import set_default_torch_num_threads
    drop_harmless_warnings()
    logger = logging.getLogger("vllm.v1.worker.cpu_worker")

    def skip_set_num_threads(x):  # as cpu_worker.py's CPUWorker.init_device defines it
        logger.warning("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.")
    monkeypatch.setattr(torch, "set_num_threads", skip_set_num_threads)
    with _Shown(logger) as shown:
        with set_default_torch_num_threads(1):  # vLLM's: on entry and on exit
            pass
        torch.set_num_threads(2)  # ours
    assert shown == [SKIPPED_THREADS]


def test_only_vllms_own_look_at_the_deprecated_reduce_op_is_quieted():
    """vLLM's Triton kernel registry looks at every module attribute, torch.distributed.reduce_op too, which warns
    FutureWarning (vllm/triton_utils/dispatcher.py); the same access from other code, and any other FutureWarning
    of vLLM's module, still warn."""
    import warnings
    from machinery.console import drop_harmless_warnings
    look = "import torch.distributed as dist\nhasattr(dist.reduce_op, '__dict__')\n"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drop_harmless_warnings()
        for module in ("vllm.triton_utils.dispatcher", "mycode"):
            exec(compile(look, f"{module}.py", "exec"), {"__name__": module})
        warnings.warn_explicit("another deprecation", FutureWarning, "dispatcher.py", 1,
                               module="vllm.triton_utils.dispatcher")
    assert [(w.category, w.filename, str(w.message)[:40]) for w in caught] == [
        (FutureWarning, "mycode.py", "`torch.distributed.reduce_op` is depreca"),
        (FutureWarning, "dispatcher.py", "another deprecation")]
