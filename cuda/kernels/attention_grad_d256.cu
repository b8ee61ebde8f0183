// The attention backward for head dimensions up to 256 (attention_grad.cuh).
#include "attention_grad.cuh"

AG_INSTANCE(256, 8)
