package paging

import (
	"fmt"
	"slices"
)

// Placement is one device's share of a model spread over several devices:
// the decoder blocks [FirstBlock, EndBlock), and its layers in the model's
// numbering (the embedding with the first share, the final norm and head
// with the last).
type Placement struct {
	Device     int   `json:"device"`
	FirstBlock int   `json:"first_block"`
	EndBlock   int   `json:"end_block"`
	Layers     []int `json:"layers"`
	Bytes      int64 `json:"bytes"`
	Budget     int64 `json:"budget_bytes"`
}

// PlaceLayers splits the model's decoder blocks into contiguous ranges, one
// per device, in proportion to the devices' budgets (pipeline placement):
// device d's layers add up to about its share of the weight bytes. Every
// device gets at least one block.
func PlaceLayers(model ModelInfo, budgets []int64) ([]Placement, error) {
	n, L := len(budgets), model.NumLayers
	if n == 0 {
		return nil, fmt.Errorf("paging: placement over no devices")
	}
	if len(model.Layers) != L+2 {
		return nil, fmt.Errorf("paging: placement: model has %d layers for %d blocks (want blocks + 2)", len(model.Layers), L)
	}
	if n > L {
		return nil, fmt.Errorf("paging: %d devices for %d decoder blocks: each device needs at least one", n, L)
	}
	var sumBudget, total int64
	for d, b := range budgets {
		if b <= 0 {
			return nil, fmt.Errorf("paging: device %d has budget %d", d, b)
		}
		sumBudget += b
	}
	for _, l := range model.Layers {
		total += l.Bytes
	}
	out := make([]Placement, n)
	block, cum, cumBudget := 0, model.Layers[0].Bytes, int64(0)
	for d := range n {
		cumBudget += budgets[d]
		target := float64(total) * float64(cumBudget) / float64(sumBudget)
		p := Placement{Device: d, FirstBlock: block, Budget: budgets[d]}
		if d == 0 {
			p.Layers = append(p.Layers, 0)
			p.Bytes += model.Layers[0].Bytes
		}
		for block < L {
			left := L - block // blocks not yet placed
			need := n - 1 - d // later devices need one each
			taken := block - p.FirstBlock
			b := model.Layers[block+1].Bytes
			if left <= need || (taken > 0 && d < n-1 && float64(cum)+float64(b)/2 > target) {
				break
			}
			p.Layers = append(p.Layers, block+1)
			p.Bytes += b
			cum += b
			block++
		}
		p.EndBlock = block
		if d == n-1 {
			p.Layers = append(p.Layers, L+1)
			p.Bytes += model.Layers[L+1].Bytes
		}
		out[d] = p
	}
	return out, nil
}

// Stage returns the ModelInfo of one device's share, for planning its
// residency within its own budget: its layers, its blocks' buffers (the KV
// cache), and the buffers of the last layer only on the device that holds
// it.
func (m ModelInfo) Stage(p Placement) ModelInfo {
	s := m
	s.Layers = make([]LayerInfo, len(p.Layers))
	for i, l := range p.Layers {
		s.Layers[i] = m.Layers[l]
	}
	s.NumLayers = p.EndBlock - p.FirstBlock
	s.NoEmbedding = m.NoEmbedding || !slices.Contains(p.Layers, 0)
	if !slices.Contains(p.Layers, len(m.Layers)-1) {
		s.Reserve = slices.DeleteFunc(slices.Clone(m.Reserve), func(b Buffer) bool { return b.LastLayer })
	}
	return s
}
