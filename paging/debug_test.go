package paging

import "fmt"

func (p *Pager) dump() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := fmt.Sprintf("inflight %d ring %d/%d\n", p.inflight, p.ringUsed, p.ringCap)
	for _, e := range p.layers {
		s += fmt.Sprintf("L%d res %d/%v str %d/%v inRing %v pins %d waiters %d loading %v\n", e.layer, e.resBytes, e.resLoaded, e.strBytes, e.strLoaded, e.strInRing, e.pins, e.waiters, e.loading)
	}
	s += fmt.Sprintf("%+v\n", p.bg.Categories())
	return s
}
