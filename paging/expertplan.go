package paging

import (
	"errors"
	"fmt"
	"slices"
)

// hasExperts reports whether any layer of the model lists experts.
func hasExperts(m ModelInfo) bool {
	return slices.ContainsFunc(m.Layers, func(li LayerInfo) bool { return len(li.Experts) > 0 })
}

func cloneNames(experts [][]string) [][]string {
	if experts == nil {
		return nil
	}
	out := make([][]string, len(experts))
	for e, names := range experts {
		out[e] = slices.Clone(names)
	}
	return out
}

// expertLayout is how a layer's experts and routing tensors split from
// the rest of its tensors.
type expertLayout struct {
	rest         []TensorSpec // the tensors planned as a layer's
	routing      []TensorSpec // kept resident
	experts      int
	expertBytes  int64 // all its experts' bytes
	slotBytes    int64 // its largest expert in the cache: each tensor aligned
	hostBytes    int64 // its experts' host copies, each tensor padded
	routingBytes int64
}

// splitExperts splits a layer described with experts.
func splitExperts(l int, li LayerInfo) (expertLayout, error) {
	var x expertLayout
	if len(li.Tensors) == 0 {
		return x, fmt.Errorf("paging: plan: layer %d lists experts but not its tensors", l)
	}
	if err := checkSpecs(l, li.Tensors); err != nil {
		return x, err
	}
	if err := checkExperts(l, li.Tensors, li.Experts, li.Routing); err != nil {
		return x, err
	}
	byName := map[string]TensorSpec{}
	for _, t := range li.Tensors {
		byName[t.Name] = t
	}
	taken := map[string]bool{}
	for _, names := range li.Experts {
		var slot int64
		for _, n := range names {
			t := byName[n]
			taken[n] = true
			x.expertBytes += t.Bytes
			x.hostBytes += alignHost(t.Bytes)
			slot += alignUp(t.Bytes)
		}
		x.slotBytes = max(x.slotBytes, slot)
	}
	x.experts = len(li.Experts)
	for _, n := range li.Routing {
		taken[n] = true
		x.routing = append(x.routing, byName[n])
		x.routingBytes += byName[n].Bytes
	}
	for _, t := range li.Tensors {
		if !taken[t.Name] {
			x.rest = append(x.rest, t)
		}
	}
	return x, nil
}

// planExperts plans a model whose layers hold experts (WithExpertCache):
// the layers without their experts and routing tensors as plan does, with
// room left for the routing tensors (resident) and the smallest expert
// cache, then the expert cache grown into what the budget has left, in
// whole experts.
func planExperts(model ModelInfo, budget int64, strategy Strategy, contextLen, batch int, o planOptions) (*PlanResult, error) {
	if len(o.whole) > 0 {
		return nil, fmt.Errorf("paging: plan %s: an expert cache and layers streamed whole (the CPU's layers) do not go together", strategy)
	}
	size := o.allocSize
	if size == nil {
		size = func(n int64) int64 { return n }
	}
	n := len(model.Layers)
	inner := model
	inner.Layers = make([]LayerInfo, n)
	xs := make([]expertLayout, n)
	var total int
	var slot, expertBytes, hostBytes, routingBytes, routingCost int64
	for l, li := range model.Layers {
		if len(li.Experts) == 0 {
			inner.Layers[l] = LayerInfo{Bytes: li.Bytes, Tensors: li.Tensors}
			continue
		}
		x, err := splitExperts(l, li)
		if err != nil {
			return nil, err
		}
		xs[l] = x
		inner.Layers[l] = LayerInfo{Tensors: x.rest}
		for _, t := range x.rest {
			inner.Layers[l].Bytes += t.Bytes
		}
		total += x.experts
		slot = max(slot, x.slotBytes)
		expertBytes += x.expertBytes
		hostBytes += x.hostBytes
		routingBytes += x.routingBytes
		for _, t := range x.routing {
			routingCost += size(t.Bytes)
		}
	}
	minSlots := min(o.expertMin, total)
	if strategy == StrategyNone { // every expert stays: the cache holds them all
		minSlots = total
	}
	cacheCost := func(slots int) int64 {
		if slots == 0 {
			return 0
		}
		return size(int64(slots) * slot)
	}
	minCache := cacheCost(minSlots)
	o.extraFixed += routingCost + minCache
	p, err := plan(inner, budget, strategy, contextLen, batch, o)
	if err != nil {
		var be *BudgetError
		if errors.As(err, &be) {
			be.Detail += fmt.Sprintf(", routing tensors %s resident and an expert cache of at least %d experts (%s) beside the layers",
				FormatSize(routingBytes), minSlots, FormatSize(minCache))
		}
		return nil, err
	}
	// What the budget leaves beside the layers' plan is the cache's.
	room := budget - (p.PredictedPeakBytes - minCache)
	slots := minSlots
	if slot == 0 { // experts of no bytes
		slots = total
	} else if strategy != StrategyAggressive {
		slots = int(min(int64(total), room/slot))
		for slots > minSlots && cacheCost(slots) > room {
			slots--
		}
	}
	cache := int64(slots) * slot
	p.Experts, p.ExpertSlots, p.ExpertSlotBytes, p.ExpertCacheBytes, p.ExpertBytes = total, slots, slot, cache, expertBytes
	p.WeightBytes += routingBytes + expertBytes
	p.ResidentBytes += routingBytes
	p.DeviceOverheadBytes += routingCost - routingBytes + cacheCost(slots) - cache
	if strategy != StrategyAggressive && slots < total {
		p.HostCacheBytes += hostBytes // experts evicted come back from host memory
	}
	for l := range p.Layers {
		lp, x := &p.Layers[l], xs[l]
		if x.experts == 0 {
			continue
		}
		lp.Bytes += x.routingBytes + x.expertBytes
		lp.ResidentBytes += x.routingBytes
		lp.ExpertBytes, lp.Experts = x.expertBytes, x.experts
	}
	p.PredictedPeakBytes = p.ResidentBytes + p.RingBytes + p.ExpertCacheBytes + p.DeviceOverheadBytes + p.KVCacheBytes + p.ActivationBytes + p.WorkspaceBytes
	if p.PredictedPeakBytes > budget { // a planner bug, not bad input
		return nil, fmt.Errorf("paging: plan %s: internal error: predicted peak %d with the expert cache exceeds budget %d", strategy, p.PredictedPeakBytes, budget)
	}
	return p, nil
}
