"""nn.Modules of the models. They call ops/; they never launch kernels inline."""
