"""Run a Megatron-LM script so that its distributed optimizer resumes with torch's own Adam.

    torchrun --nproc-per-node 4 scripts/mlm_torch_adam.py pretrain_gpt.py <its flags>

Megatron-LM (seen at d98e8a64, 2026-08) falls back to torch's AdamW when neither Transformer Engine nor
apex is installed, and then cannot resume a --use-distributed-optimizer checkpoint, its own included
(scripts/mlm_gpu_resume.py's controls show it; docs/megatron-lm-gpu.md has the errors):
  - torch format: load_state_dict hands every parameter's state ONE shared `step` tensor, then
    load_parameter_state copies each state key from distrib_optim.pt, which holds no `step`
    (KeyError: 'step'). Were it to load, torch's Adam would add 1 to that shared tensor once per
    parameter at every step, so the bias correction of the resumed steps would be wrong.
  - torch_dist: loading first asks the optimizer for its state_dict(), whose step is read from the
    torch Adam state that does not exist before a first step (AssertionError: len(steps) == 1).
With TE's or apex's Adam the step lives in the param groups and neither happens. The patches below
give torch's Adam what those keep: the state exists (zero moments, step 0) before a load asks for it,
and after a load every parameter has its own step tensor holding the checkpoint's step, as a torch
Adam that had run those steps would. They touch loading only: a run that loads nothing trains the same
(docs/megatron-lm-gpu.md compares the reference losses with and without them). Nothing changes when TE
or apex is installed. Megatron-LM's source is not modified; this file is not part of ckptool.
"""
import runpy
import sys


def patch() -> None:
    import torch
    from megatron.core.optimizer import distrib_optimizer as dist_opt

    if dist_opt.HAVE_APEX_OR_TE:
        return
    cls = dist_opt.DistributedOptimizer

    def ensure_state(self) -> None:
        """torch's Adam makes its state at the first step; a load before any step needs it there."""
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = self.optimizer.state[param]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                    state.setdefault("exp_avg", torch.zeros_like(param))
                    state.setdefault("exp_avg_sq", torch.zeros_like(param))

    def own_steps(self) -> None:
        """One step tensor per parameter (load_state_dict shares one among all of them)."""
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].detach().clone()

    state_dict, load_state_dict = cls.state_dict, cls.load_state_dict
    set_states = cls._set_main_param_and_optimizer_states

    def patched_state_dict(self):
        ensure_state(self)
        return state_dict(self)

    def patched_load_state_dict(self, sd):
        load_state_dict(self, sd)
        own_steps(self)

    def patched_set_states(self, model_param, tensors):
        if "step" not in tensors:  # distrib_optim.pt holds no step: the one load_state_dict set stays
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
            if "step" in state:
                tensors = dict(tensors, step=state["step"].detach().clone())
        return set_states(self, model_param, tensors)

    cls.state_dict = patched_state_dict
    cls.load_state_dict = patched_load_state_dict
    cls._set_main_param_and_optimizer_states = patched_set_states


if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    try:
        patch()
    except Exception as exc:  # the run goes on unpatched: its log says so, its failure is Megatron-LM's own
        print(f"mlm_torch_adam.py: patches NOT applied ({type(exc).__name__}: {exc})", flush=True)
    runpy.run_path(script, run_name="__main__")
