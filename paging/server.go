package paging

import (
	"context"
	"fmt"

	"github.com/strata-llm/strata/tensor"
)

// Server serves a model's layers under a budget: a *Pager (explicit copies)
// or a *Unified (managed memory). nn adapts it to nn.Weights.
type Server interface {
	Acquire(ctx context.Context, layer int) (map[string]*tensor.Tensor, error)
	Release(layer int)
	// MarkStep marks a decoded token; see Pager.MarkStep.
	MarkStep() int64
	Stats() Stats
	Close() error
}

var (
	_ Server = (*Pager)(nil)
	_ Server = (*Unified)(nil)
)

// NewServer returns the server for a memory mode: a Pager for
// ModeExplicit, a Unified with prefetch for ModeUnified and without for
// ModeUnifiedNoPrefetch. opts apply to the Pager.
func NewServer(ctx context.Context, mode MemoryMode, src Source, bg *Budget, plan *PlanResult, opts Options) (Server, error) {
	switch mode {
	case ModeExplicit, "":
		return NewPager(src, bg, plan, opts)
	case ModeUnified:
		return NewUnified(ctx, src, bg, plan, true)
	case ModeUnifiedNoPrefetch:
		return NewUnified(ctx, src, bg, plan, false)
	}
	return nil, fmt.Errorf("paging: unknown memory mode %q", mode)
}
