// triton_kernels.cu: the custom CUDA kernels of the trainer, included by train_gpt.cu.
//
// Named after record 61's triton_kernels.py so the two map one to one. It will hold the kernels
// that the Python record gets from Triton and FlashAttention-3: the symmetric X@X^T and
// b*A + c*A@A of Polar Express, the fused linear+ReLU^2, the fused soft-capped multi-token-
// prediction cross-entropy, the tiled transposes of the tied embedding, and varlen sliding-window
// attention. Every kernel here has an oracle test in tests/.
#pragma once
