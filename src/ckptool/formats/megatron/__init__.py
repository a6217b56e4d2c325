"""Megatron-LM's torch format (mp_rank_XX[_YYY]/model_optim_rng.pt): reader, writer, names, args, optimizer state (plain and distributed), and its torch-free quick part for inspect."""
