package quant

import (
	"fmt"
	"os"
	"strings"
)

// VecDot returns the integer product of one weight row w (n elements of
// type t) with the activations xq (QuantizeRow's output for n elements).
func VecDot(t Type, w, xq []byte, n int) (float32, error) {
	var out [1]float32
	if err := checkVecDot("vec dot", t, len(out), n, len(w), len(xq)); err != nil {
		return 0, err
	}
	active.gemv[t](out[:], w, xq)
	return out[0], nil
}

// GEMV computes out[r] = the integer product of weight row r with xq for
// r < rows: w holds rows rows of cols elements of type t, one after the
// other, and xq the activations (QuantizeRow's output for cols elements).
// len(out) must be rows. A caller that splits a matrix among goroutines
// passes each one its range of rows and out.
func GEMV(t Type, out []float32, w []byte, rows, cols int, xq []byte) error {
	if rows != len(out) {
		return fmt.Errorf("quant: gemv %v: %d rows but %d outputs: %w", t, rows, len(out), ErrLength)
	}
	if err := checkVecDot("gemv", t, rows, cols, len(w), len(xq)); err != nil {
		return err
	}
	if rows > 0 {
		active.gemv[t](out, w, xq)
	}
	return nil
}

func noIntegerProduct(op string, t Type) error {
	if !t.Known() {
		return fmt.Errorf("quant: %s: %w: %v", op, ErrUnknownType, t)
	}
	return fmt.Errorf("quant: %s: %w: %v has no integer product", op, ErrUnsupported, t)
}

// checkVecDot checks the operands of rows products of n elements.
func checkVecDot(op string, t Type, rows, n, wlen, xlen int) error {
	a, ok := actOf(t)
	if !ok {
		return noIntegerProduct(op, t)
	}
	if n <= 0 || n%a.block != 0 {
		return fmt.Errorf("quant: %s %v: %d elements is not a positive whole number of %d-element blocks: %w", op, t, n, a.block, ErrLength)
	}
	rowBytes := n / t.BlockSize() * t.BlockBytes()
	if rows < 0 || (rows > 0 && wlen/rows != rowBytes) || wlen != rows*rowBytes {
		return fmt.Errorf("quant: %s %v: %d rows of %d elements need %d bytes of weights, have %d: %w", op, t, rows, n, rows*rowBytes, wlen, ErrLength)
	}
	if want := n / a.block * a.blockBytes(); xlen != want {
		return fmt.Errorf("quant: %s %v: %d elements need %d bytes of activations (QuantizeRow's), have %d: %w", op, t, n, want, xlen, ErrLength)
	}
	return nil
}

// gemvFunc computes len(out) rows of products of the weight rows in w with
// xq; the operands are checked.
type gemvFunc func(out []float32, w, xq []byte)

// vecKernels is one implementation of the integer products, indexed by
// weight type.
type vecKernels struct {
	name string
	gemv [Q6_K + 1]gemvFunc
}

// goKernels are the Go kernels: the reference every other table matches,
// and what runs where no assembly does.
var goKernels = vecKernels{
	name: "go",
	gemv: [...]gemvFunc{
		Q4_0: rowsOf(Q4_0, dotQ4_0Go),
		Q4_1: rowsOf(Q4_1, dotQ4_1Go),
		Q5_0: rowsOf(Q5_0, dotQ5_0Go),
		Q5_1: rowsOf(Q5_1, dotQ5_1Go),
		Q8_0: rowsOf(Q8_0, dotQ8_0Go),
		Q4_K: rowsOf(Q4_K, dotQ4_KGo),
		Q5_K: rowsOf(Q5_K, dotQ5_KGo),
		Q6_K: rowsOf(Q6_K, dotQ6_KGo),
	},
}

// rowsOf makes a gemv from a one-row product.
func rowsOf(t Type, dot func(w, xq []byte) float32) gemvFunc {
	return func(out []float32, w, xq []byte) {
		rb := len(w) / len(out)
		for r := range out {
			out[r] = dot(w[r*rb:(r+1)*rb], xq)
		}
	}
}

// KernelsEnv names the environment variable that chooses the kernels of
// the integer products: "go" for the Go kernels, "avx2" or "avx512" for
// the x86-64 assembly (where the processor has it; otherwise the best it
// has below the one named); unset or empty means the fastest. It is the
// variable the tensor package's CPU backend reads for its own kernels, so
// one setting chooses both.
const KernelsEnv = "STRATA_CPU_KERNELS"

// allKernels lists the kernel tables this machine runs, fastest first; the
// Go table is last.
func allKernels() []*vecKernels { return append(archKernels(), &goKernels) }

// kernelsNamed returns the table called name, or the best one below it
// that this machine runs; "" or an unknown name means the fastest.
func kernelsNamed(name string) *vecKernels {
	avail := allKernels()
	rank := map[string]int{"go": 0, "avx2": 1, "avx512": 2}
	want, ok := rank[strings.ToLower(strings.TrimSpace(name))]
	if !ok {
		return avail[0]
	}
	for _, k := range avail {
		if rank[k.name] <= want {
			return k
		}
	}
	return &goKernels
}

// active is the table the package functions use, chosen once.
var active = kernelsNamed(os.Getenv(KernelsEnv))

// Kernels names the kernels the integer products run: "avx512", "avx2" or
// "go". See KernelsEnv.
func Kernels() string { return active.name }
