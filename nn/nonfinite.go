package nn

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/tensor"
)

// ErrNonFinite is wrapped by every error reporting NaN or infinite values:
// a forward whose logits hold some (*NonFiniteError), an optimizer step that
// makes a weight non-finite, a Save of such weights.
var ErrNonFinite = errors.New("non-finite values")

// NonFiniteError says where NaN or infinite values first appeared in a
// forward pass whose logits held some: the first layer whose output holds
// one, and the first position in that output. The layer is numbered as
// Weights numbers them; the head's layer is named twice: "the final norm"
// when its norm's output holds the value, "the lm head" when only the
// logits do (then Pos is the first position whose logits were computed
// and hold one: the last of the step unless every position's were asked
// for).
type NonFiniteError struct {
	Layer int     // 0 the embedding, 1..L the decoder blocks, L+1 the head
	Name  string  // "the embedding", "block 2", "the final norm", "the lm head"
	Pos   int     // the session position of the first row holding one
	Value float32 // the first such value: NaN, +Inf or -Inf
}

func (e *NonFiniteError) Error() string { return "nn: " + e.where() }

func (e *NonFiniteError) where() string {
	return fmt.Sprintf("non-finite values (%v) first appear in the output of %s (layer %d) at position %d",
		e.Value, e.Name, e.Layer, e.Pos)
}

// lossError is a training step's non-finite loss, with where the forward
// first produced a non-finite value.
type lossError struct {
	loss float64
	*NonFiniteError
}

func (e *lossError) Error() string {
	return fmt.Sprintf("nn: train: the loss is %v: %s", e.loss, e.where())
}

func (e *lossError) Unwrap() error { return e.NonFiniteError }

func (e *NonFiniteError) Unwrap() error { return ErrNonFinite }

// firstNonFiniteF32 returns the index of the first NaN or infinity in v, or -1.
func firstNonFiniteF32(v []float32) int { return tensor.FirstNonFinite(tensor.F32, f32View(v)) }

// f32View views v's storage as bytes.
func f32View(v []float32) []byte {
	if len(v) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), 4*len(v))
}

// diagnosis finds the first layer of a re-run forward whose output is not
// finite. Its hooks download each layer's hidden state from the backend
// that holds it; only a forward whose logits were not finite pays for that.
type diagnosis struct {
	cfg       *arch.Config                   // the model's layers
	backendOf func(layer int) tensor.Backend // where the layer's output lives
	buf       []byte
}

// layerName names a layer in Weights' numbering.
func (d *diagnosis) layerName(layer int) string {
	switch kind, block, _ := d.cfg.LayerKind(layer); kind {
	case arch.Embedding:
		return "the embedding"
	case arch.Block:
		return fmt.Sprintf("block %d", block)
	}
	return "the final norm"
}

// hookAt returns the Hook for a chunk whose first row is at position pos:
// it returns a *NonFiniteError for the first hidden state holding a NaN or
// an infinity, which stops the forward there.
func (d *diagnosis) hookAt(pos int) Hook {
	return func(layer int, h *tensor.Tensor) error {
		n := int(h.NumBytes())
		if len(d.buf) < n {
			d.buf = make([]byte, n)
		}
		b := d.buf[:n]
		if err := d.backendOf(layer).Download(b, h); err != nil {
			return fmt.Errorf("nn: looking for non-finite values in the output of %s: %w", d.layerName(layer), err)
		}
		i := tensor.FirstNonFinite(tensor.F32, b)
		if i < 0 {
			return nil
		}
		row := i / max(1, h.Len()/max(1, h.Shape()[0]))
		return &NonFiniteError{Layer: layer, Name: d.layerName(layer), Pos: pos + row, Value: float32(tensor.ElementF64(tensor.F32, b, i))}
	}
}

// result turns the re-run's outcome into the error Forward returns: the
// *NonFiniteError a hook found, else the LM head when the re-run's logits
// (rows at positions pos0.., every position when all is set, else only the
// last of n) are not finite either.
func (d *diagnosis) result(logits []float32, err error, pos0, n int, all bool, vocab int) error {
	var ne *NonFiniteError
	if errors.As(err, &ne) {
		return ne
	}
	if err != nil {
		return fmt.Errorf("nn: the logits hold non-finite values; re-running the step to find where: %w", err)
	}
	i := firstNonFiniteF32(logits)
	if i < 0 {
		return fmt.Errorf("%w: the logits held some, a re-run of the same step gave none", ErrNonFinite)
	}
	pos := pos0 + n - 1
	if all {
		pos = pos0 + i/vocab
	}
	return &NonFiniteError{Layer: d.cfg.HeadLayer(), Name: "the lm head", Pos: pos, Value: logits[i]}
}
