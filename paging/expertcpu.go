package paging

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// ExpertCPUPolicy says when an expert missing from the expert cache is
// computed on the CPU from host memory instead of uploaded to the device
// (ExpertOnCPU, HostExpert).
type ExpertCPUPolicy string

// The policies of ExpertOnCPU.
const (
	// ExpertCPUAuto computes a missing expert on the CPU when the rates
	// (Options.Rates) predict that its product there, with the hand-over
	// of its tokens' rows and outputs, ends before its upload would: in
	// decode (one token) usually, in a long prefill (many tokens for each
	// expert) not. Without rates it never does.
	ExpertCPUAuto ExpertCPUPolicy = "auto"
	// ExpertCPUNever uploads every missing expert.
	ExpertCPUNever ExpertCPUPolicy = "never"
	// ExpertCPUAlways computes every missing expert on the CPU.
	ExpertCPUAlways ExpertCPUPolicy = "always"
)

// ParseExpertCPUPolicy accepts "auto", "never" and "always",
// case-insensitive; empty is ExpertCPUAuto.
func ParseExpertCPUPolicy(s string) (ExpertCPUPolicy, error) {
	switch p := ExpertCPUPolicy(strings.ToLower(strings.TrimSpace(s))); p {
	case "":
		return ExpertCPUAuto, nil
	case ExpertCPUAuto, ExpertCPUNever, ExpertCPUAlways:
		return p, nil
	}
	return "", fmt.Errorf("paging: unknown policy %q for experts on the CPU (want auto, never or always)", s)
}

// ExpertCPUServer is an ExpertServer that can hand a missing expert's
// weights in host memory to the CPU instead of uploading it (a Pager).
type ExpertCPUServer interface {
	// ExpertOnCPU reports whether the layer's expert, chosen by tokens
	// tokens of a chunk, is to be computed on the CPU: it is not in the
	// expert cache nor on its way there, and the policy says so.
	ExpertOnCPU(layer, expert, tokens int) bool
	// HostExpert returns the expert's tensors in host memory by name,
	// for tokens tokens: its host copy, read from the source when the
	// host cache has none (and kept there when it has room). The
	// tensors stay valid until release is called.
	HostExpert(ctx context.Context, layer, expert, tokens int) (ts map[string]*tensor.Tensor, release func(), err error)
}

var _ ExpertCPUServer = (*Pager)(nil)

// ExpertCPUTime is the predicted time of an expert of bytes weight bytes
// computed on the CPU for tokens tokens (each token's product reads the
// weights: the CPU's products are bound by memory reading at these
// sizes), with the hand-over of the tokens' rows down and their outputs
// up; ExpertUploadTime that of its upload. ok is false when r cannot say.
func ExpertCPUTime(r Rates, bytes int64, tokens int) (cpu, upload time.Duration, ok bool) {
	if r.CPU <= 0 || r.H2D <= 0 {
		return 0, 0, false
	}
	sec := func(x float64) time.Duration { return time.Duration(x * float64(time.Second)) }
	cpu = sec(float64(bytes)*float64(max(tokens, 1))/r.CPU) + 2*r.Handoff
	upload = sec(float64(bytes) / r.H2D)
	return cpu, upload, true
}

// ExpertOnCPU reports whether the layer's expert, chosen by tokens tokens,
// is computed on the CPU: never when it is cached or loading, or without
// an expert cache for the layer; else as Options.ExpertsCPU says
// (ExpertCPUAuto: when ExpertCPUTime predicts the CPU first).
func (p *Pager) ExpertOnCPU(layer, expert, tokens int) bool {
	if !p.PagesExperts(layer) || p.expertsCPU == ExpertCPUNever || p.expertsCPU == "" {
		return false
	}
	all := p.ex.layers[layer]
	if expert < 0 || expert >= len(all) {
		return false
	}
	e := all[expert]
	p.mu.Lock()
	cached := e.loaded || e.loading
	p.mu.Unlock()
	if cached {
		return false
	}
	if p.expertsCPU == ExpertCPUAlways {
		return true
	}
	if p.rates == nil {
		return false
	}
	cpu, upload, ok := ExpertCPUTime(*p.rates, e.bytes, tokens)
	return ok && cpu < upload
}

// HostExpert returns the tensors of the layer's expert in host memory, for
// the CPU to compute with (ExpertOnCPU), counting it in Stats.ExpertsOnCPU
// and its tokens in ExpertCPUTokens. The tensors are its host copy when
// the host cache holds one; else it is read from the source, into a host
// copy the host cache keeps when it has room (pinned where the device
// has pinned memory, as a load would keep it), or into a buffer of its
// own that release lets go. The host copy stays until the pager closes.
// On error nothing is kept and nothing counted.
func (p *Pager) HostExpert(ctx context.Context, layer, expert, tokens int) (map[string]*tensor.Tensor, func(), error) {
	es, err := p.expertEntries("compute on the CPU", layer, []int{expert})
	if err != nil {
		return nil, nil, err
	}
	e := es[0]
	fail := func(err error) error {
		return fmt.Errorf("paging: expert %d of layer %d on the CPU: %w", expert, layer, err)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, nil, fail(errClosed)
	}
	buf := e.host
	admitted := false
	if buf == nil && p.hostUsed+p.hostReserved+e.hostSize <= p.hostCap {
		p.hostUsed += e.hostSize // given back if the read fails
		admitted = true
	}
	p.inflight++ // Close waits for the read
	p.mu.Unlock()
	done := func() {
		p.mu.Lock()
		p.inflight--
		p.changedLocked()
		p.mu.Unlock()
	}
	var read int64
	pinned, fromArena := false, false
	// drop gives back a buffer read here that the host cache does not
	// keep (an arena's piece stays with the arena until Close).
	drop := func() {
		if !admitted {
			return
		}
		p.expertHostFree(buf, pinned, fromArena)
		p.mu.Lock()
		p.hostUsed -= e.hostSize
		p.mu.Unlock()
	}
	if buf == nil {
		switch {
		case admitted:
			// Pinned where the device has it, as a load would keep it: the
			// expert may be uploaded from this copy later.
			buf, pinned, fromArena = p.expertHostAlloc(e.hostSize)
		default:
			buf = make([]byte, e.hostSize)
		}
		for k, s := range e.specs {
			err := ctx.Err()
			if err == nil {
				err = p.src.ReadTensor(ctx, e.layer, s.Name, buf[e.hostOffs[k]:e.hostOffs[k]+s.Bytes])
			}
			if err != nil {
				drop()
				done()
				return nil, nil, fail(fmt.Errorf("tensor %s: reading: %w", s.Name, err))
			}
			read += s.Bytes
		}
	}
	ts := make(map[string]*tensor.Tensor, len(e.specs))
	for k, s := range e.specs {
		t, err := tensor.FromBytes(s.DType, s.Shape, buf[e.hostOffs[k]:e.hostOffs[k]+s.Bytes])
		if err != nil {
			drop()
			done()
			return nil, nil, fail(err)
		}
		ts[s.Name] = t
	}
	p.mu.Lock()
	release := func() {}
	if admitted {
		if e.host == nil {
			e.host, e.hostPinned, e.hostArena = buf, pinned, fromArena // the host cache keeps it
			if pinned && !fromArena {
				p.pinnedBytes += int64(len(buf))
			}
		} else {
			// Another read kept its copy first: this one goes once the
			// caller is done with it.
			p.hostUsed -= e.hostSize
			if pinned && !fromArena {
				b := buf
				release = func() { _ = p.hostFree(b, true) }
			}
		}
	}
	p.st.BytesDiskToHost += read
	p.st.ExpertsOnCPU++
	p.st.ExpertCPUTokens += int64(tokens)
	p.st.ExpertCPUBytes += e.bytes
	p.mu.Unlock()
	done()
	return ts, release, nil
}
