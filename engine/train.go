package engine

import (
	"context"
	"errors"
	"fmt"

	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// Training is a model assembled for training on one device: the trainer
// computes on the parameters directly, or, under a budget, through a pager
// made anew for every step, because an update makes the pager's device
// copies stale. One model and trainer serve every step, so that the
// trainer's staging buffers last the run.
type Training struct {
	params  *nn.Params
	backend tensor.Backend
	owned   tensor.Backend // opened here, closed by Close
	tr      *nn.Trainer
	paged   *stepWeights // nil when training directly on the parameters
	budget  *paging.Budget
	plan    *paging.PlanResult
	moved   int64 // bytes the pagers moved
	calls   int
}

// stepWeights serves the current step's pager.
type stepWeights struct{ *paging.Pager }

// OpenTraining assembles params for training sequences of up to tokens
// positions with t's options, on the one device of o (o.Memory.Budgets
// and Fractions give its budget; the other memory settings do not apply).
// On the CPU with no budget given the trainer computes on the parameters
// directly; on a device, or with a budget, the layers are paged under the
// budget, which the default policy sets when none is given.
func OpenTraining(ctx context.Context, params *nn.Params, o Options, t nn.TrainOptions, tokens int) (tr *Training, err error) {
	if len(o.Devices)+len(o.Backends) > 1 {
		return nil, errors.New("engine: training runs on one device")
	}
	r := &Training{params: params}
	defer func() {
		if err != nil {
			r.Close()
		}
	}()
	switch {
	case len(o.Backends) == 1:
		r.backend = o.Backends[0]
	default:
		spec := "auto"
		if len(o.Devices) == 1 {
			spec = o.Devices[0]
		}
		if r.backend, err = tensor.OpenDevice(spec, tensor.DeviceOptions{Threads: o.Threads}); err != nil {
			return nil, err
		}
		r.owned = r.backend
	}
	cfg := params.Config()
	_, hasMemory := tensor.Caching(r.backend)
	limit, given := int64(0), false
	switch m := o.Memory; {
	case len(m.Budgets) > 0 && len(m.Fractions) > 0:
		return nil, errors.New("engine: give budgets or fractions, not both")
	case len(m.Budgets) > 1 || len(m.Fractions) > 1:
		return nil, errors.New("engine: training runs on one device: give one budget")
	case len(m.Budgets) == 1 && m.Budgets[0] > 0:
		limit, given = m.Budgets[0], true
	case len(m.Fractions) == 1:
		if limit, err = paging.DeviceFraction(r.backend, m.Fractions[0]); err != nil {
			return nil, err
		}
		given = true
	}
	onHost := !hasMemory
	if !given && onHost {
		m, err := nn.New(cfg, r.backend, nil, params)
		if err != nil {
			return nil, err
		}
		if r.tr, err = nn.NewTrainer(m, t); err != nil {
			return nil, err
		}
		return r, nil
	}
	if !given {
		limit = DefaultBudget(r.backend)
	}
	layers, err := paging.DescribeSource(params)
	if err != nil {
		return nil, err
	}
	// Training keeps no KV cache: its reserve is the training activations
	// and rotary tables, and on a device one layer's gradients.
	info := paging.ModelInfo{Layers: layers, NumLayers: cfg.NumLayers, Reserve: nn.TrainReserve(cfg, tokens, t.Segments, !onHost)}
	r.plan, err = paging.Plan(info, limit, paging.StrategyBalanced, 1, 1, paging.WithDevice(r.backend))
	if err != nil {
		var be *paging.BudgetError
		if errors.As(err, &be) {
			return nil, fmt.Errorf("engine: a budget of %s is too small for training %d positions with %d checkpoint segments: the smallest budget is %s: %w",
				paging.FormatSize(limit), tokens, max(t.Segments, 1), paging.FormatSize(be.Needed), paging.ErrBudgetTooSmall)
		}
		return nil, err
	}
	if r.budget, err = paging.NewBudget(r.backend, limit, r.backend.Name()); err != nil {
		return nil, err
	}
	r.paged = &stepWeights{}
	m, err := nn.New(cfg, r.backend, r.budget, r.paged)
	if err != nil {
		return nil, err
	}
	if r.tr, err = nn.NewTrainer(m, t); err != nil {
		return nil, err
	}
	return r, nil
}

// With calls fn with a trainer over the current parameters; under a
// budget, with the layers paged for this call.
func (r *Training) With(fn func(*nn.Trainer) error) (err error) {
	r.calls++
	if r.paged == nil {
		return fn(r.tr)
	}
	pager, err := paging.NewPager(r.params, r.budget, r.plan, paging.Options{HostCacheBytes: -1})
	if err != nil {
		return err
	}
	r.paged.Pager = pager
	defer func() {
		r.paged.Pager = nil
		r.moved += pager.Stats().BytesHostToDevice
		if cerr := pager.Close(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	return fn(r.tr)
}

// Backend is the device the training computes on.
func (r *Training) Backend() tensor.Backend { return r.backend }

// Budget is the device budget, or nil when training on the parameters
// directly.
func (r *Training) Budget() *paging.Budget { return r.budget }

// MovedPerCall is the weight bytes the pagers moved to the device per call
// of With, on average.
func (r *Training) MovedPerCall() int64 {
	if r.calls == 0 {
		return 0
	}
	return r.moved / int64(r.calls)
}

// Close frees the trainer, the budget and the device the training opened;
// it is safe on a half-built training.
func (r *Training) Close() error {
	if r == nil {
		return nil
	}
	var errs []error
	if r.tr != nil {
		errs = append(errs, r.tr.Close())
		r.tr = nil
	}
	if r.budget != nil {
		errs = append(errs, r.budget.Close())
		r.budget = nil
	}
	if r.owned != nil {
		errs = append(errs, r.owned.Close())
		r.owned = nil
	}
	return errors.Join(errs...)
}
