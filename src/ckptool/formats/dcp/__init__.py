"""megatron-core torch_dist and plain torch.distributed.checkpoint (DCP) folders: reader, writer, optimizer-state forms, and the torch-free quick part for inspect."""
