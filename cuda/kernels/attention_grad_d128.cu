// The attention backward for head dimensions up to 128 (attention_grad.cuh).
#include "attention_grad.cuh"

AG_INSTANCE(128, 4)
