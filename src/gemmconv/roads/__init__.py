"""The roads by which torch reaches a solver: the eager road (its own autograd node),
the custom ops and their autograd formula, torch.func and forward-AD rules, and the
decompositions and symbolic functions that export and ONNX need."""
