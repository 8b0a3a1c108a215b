"""The ground every part stands on: ranks and reductions, the lines a user sees, the node's cores, streams and
pinned buffers, the split's arithmetic, and the optimizers' hyper-parameter checks."""
