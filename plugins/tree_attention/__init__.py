"""The ``ssd::tree_attention`` operator: one attention op for prefill, decode, chain and tree steps.

``masks`` packs tree masks (numpy only); ``reference`` is the operator's contract in torch; ``triton_kernel`` and
``trt_plugin`` implement it on a GPU. Nothing is imported here, so importing the masks does not import torch.
"""
