// The attention backward for head dimensions up to 64 (attention_grad.cuh).
#include "attention_grad.cuh"

AG_INSTANCE(64, 2)
