package nn

import (
	"context"

	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// LayerWeights maps a layer's tensor names (arch.Config.LayerNames:
// "model.layers.3.self_attn.q_proj.weight") to tensors on the backend. It
// is the map paging serves, so a paging.Server is a Weights as it is.
type LayerWeights = map[string]*tensor.Tensor

// Weights gives the forward pass each layer's tensors while it runs. Layers
// are numbered as the loader groups them: 0 is the embedding, 1..L are the
// decoder blocks, L+1 is the final norm and LM head (holding the embedding
// table too when the embeddings are tied).
//
// Acquire may block while the layer is loaded; the tensors stay valid until
// the matching Release. A paging.Server (a Pager or a Unified) is a Weights
// under a byte budget; HostWeights keeps everything loaded; StageWeights
// serves one pipeline stage's layers from a server of its own.
type Weights interface {
	Acquire(ctx context.Context, layer int) (LayerWeights, error)
	Release(layer int)
}

var (
	_ Weights = paging.Server(nil)
	_ Weights = (*paging.Pager)(nil)
)

// ResidentWeights is a Weights that says which layers stay on the device
// from step to step (HostWeights, a paging.Pager's wholly resident
// layers): an Acquire of one neither loads it nor waits for a ring slot,
// so a decode step may hold several at once and replay them as one
// graph (graph.go).
type ResidentWeights interface {
	Resident(layer int) bool
}

var (
	_ ResidentWeights = (*HostWeights)(nil)
	_ ResidentWeights = (*paging.Pager)(nil)
)

// LayerPinner is a Weights that pins a layer without handing out its
// tensors (paging.Pager.PinLayer): PinLayer pins it as Acquire does, until
// the matching Release, and appends to fp bytes that are the same from
// pin to pin exactly when the layer's tensors are where they were. A
// decode step replays a run of resident blocks' graph after pinning them
// so, without building their maps (runGraphed).
type LayerPinner interface {
	PinLayer(ctx context.Context, layer int, fp []byte) ([]byte, error)
}

var _ LayerPinner = (*paging.Pager)(nil)

// layerPinner returns w's LayerPinner, or nil when it has none (a stage's
// weights have one when their server has).
func layerPinner(w Weights) LayerPinner {
	switch w := w.(type) {
	case stageWeights:
		if _, ok := w.srv.(LayerPinner); ok {
			return w
		}
	case LayerPinner:
		return w
	}
	return nil
}

// ExpertWeights is a Weights that serves the routed experts of some
// sparse blocks one by one, outside the layer's map (a paging.Pager whose
// plan caches experts, paging.WithExpertCache): the forward pass acquires
// the experts a chunk's tokens chose, at most ExpertSlots at once, and
// prefetches those it guesses the next sparse block will choose, from
// that block's router (AcquireResident). A Weights without it, or whose
// PagesExperts is false for a layer, serves the layer's experts in its
// map, as HostWeights does.
type ExpertWeights interface {
	PagesExperts(layer int) bool
	ExpertSlots() int
	AcquireExperts(ctx context.Context, layer int, experts []int) (map[int]LayerWeights, error)
	// AcquireExpertsLazy is AcquireExperts except that the device's wait
	// for the copies of the experts in pending (in the order they land) is
	// queued by await(e), which the caller calls before computing e: the
	// others compute while those copies are in flight.
	AcquireExpertsLazy(ctx context.Context, layer int, experts []int) (ws map[int]LayerWeights, pending []int, await func(e int) error, err error)
	ReleaseExperts(layer int, experts []int)
	PrefetchExperts(layer int, experts []int)
	AcquireResident(ctx context.Context, layer int) (LayerWeights, error)
}

var (
	_ ExpertWeights = paging.ExpertServer(nil)
	_ ExpertWeights = (*paging.Pager)(nil)
)

// CPUExpertWeights is an ExpertWeights that can hand experts missing
// from its cache to the CPU instead of uploading them (a paging.Pager with
// Options.ExpertsCPU): the forward pass asks ExpertsOnCPU which of the
// experts a chunk chose to compute on the model's CPU
// (Model.SetExpertCPU), from the tensors HostExpert returns, while the
// device uploads and computes the others.
type CPUExpertWeights interface {
	ExpertsOnCPU(layer int, experts, tokens []int, onCPU []bool)
	HostExpert(ctx context.Context, layer, expert, tokens int) (LayerWeights, func(), error)
}

var _ CPUExpertWeights = paging.ExpertCPUServer(nil)
