"""Tensor parallelism's process group and collectives (torch.distributed: gloo on CPUs, NCCL on
GPUs), and which slice of each head / channel range a rank owns. Below layers/ (which call the
collectives) and above config (which validates the sizes).

    parallel_state.py   the group of this process (rank, size), the collectives, their byte and
                        time counters; identity ops when there is no group (TP = 1)
    shard.py            pure arithmetic: a rank's range of heads, channels and vocabulary rows
"""
