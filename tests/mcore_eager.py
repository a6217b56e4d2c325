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
"""
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

