"""import_megatron_core_eager(), called by the megatron-core helpers before they import megatron.core:
its fused kernels stay plain Python.

megatron-core 0.16 sets `jit_fuser = torch.compile` when `megatron.core` is first imported (jit.py) and
decorates its fused elementwise kernels (bias-GeLU, SwiGLU, bias-dropout-add...) with it while the
package imports. Decorating imports torch's dynamo and inductor: about 4 s of every helper process's
start on a 2-core box (7 s vs 2 s for the package under load), before it does anything, and the helpers
start dozens of processes per test session. Newer megatron-core has a switch for this,
MEGATRON_DISABLE_JIT_FUSER=1 (jit_fuser = the no-op decorator); 0.16 has only disable_jit_fuser(), too
late once the package is imported. So here the first import of megatron.core sees an identity
torch.compile, torch.compile is put back at once, and megatron-core's own disable_jit_fuser() covers the
modules imported later. A fused kernel then runs its own Python body: the same maths (the helpers run on
CPU with the fusions off, except mcore_flags_helper's bias_gelu_fusion variant, whose bias-GeLU is the
same tanh formula either way), and nothing a checkpoint holds depends on it.

The same call spares each process megatron-core's first torch_dist save cost of ~4 s (more when both ranks
do it at once): its FileSystemWriterAsync (dist_checkpointing/strategies/filesystem_async.py,
_get_write_results_queue) makes the queue its writer processes report to with a multiprocessing Manager
of the "spawn" context, a fresh Python that imports the helper's __main__ (torch and megatron-core) again.
The helpers save synchronously: the rank's own process puts the results its forked workers sent it into that
queue and takes them out again, which a plain thread queue does as well (a multiprocessing.Queue would not:
its put reaches the pipe on a feeder thread, after the get_nowait that follows). The files do not depend on it.
"""
import queue

import torch


def _identity_compile(model=None, **_options):
    """torch.compile's two call forms, compiling nothing: compile(fn) and compile(**options)(fn)."""
    return model if model is not None else (lambda fn: fn)


def import_megatron_core_eager() -> None:
    """Import megatron.core with jit_fuser the identity (see the module docstring)."""
    real = torch.compile
    torch.compile = _identity_compile
    try:
        import megatron.core.jit as jit  # imports megatron.core, decorating its fused kernels
    finally:
        torch.compile = real
    jit.disable_jit_fuser()
    _write_results_queue_without_manager()


def _write_results_queue_without_manager() -> None:
    """Give megatron-core's torch_dist writer its results queue before it makes one through a spawned
    Manager (see the module docstring): the module keeps the first queue it has in _results_queue."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as writer  # the module to patch
    if getattr(writer, "_results_queue", None) is None:
        writer._results_queue = queue.Queue()

