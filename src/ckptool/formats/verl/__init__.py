"""verl's FSDP checkpoints (model_world_size_N_rank_R.pt per rank beside huggingface/): the torch-free locating part and the reader."""
