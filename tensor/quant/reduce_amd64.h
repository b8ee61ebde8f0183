// Macros shared by the package's x86-64 assembly files.

// REDUCE8 folds the eight 32-bit lanes of y (x its low half) with OP (an
// integer maximum or sum) into the low lane of x; t is scratch.
#define REDUCE8(OP, y, x, t) \
	VEXTRACTI128 $1, y, t; \
	OP t, x, x; \
	VPSHUFD $0x4e, x, t; \
	OP t, x, x; \
	VPSHUFD $0xb1, x, t; \
	OP t, x, x
