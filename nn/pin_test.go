package nn

import (
	"context"
	"strings"
	"testing"

	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// fakeServer is a paging.Server that records its calls; pinner adds
// PinLayer.
type fakeServer struct{ calls []string }

func (f *fakeServer) Acquire(ctx context.Context, layer int) (map[string]*tensor.Tensor, error) {
	f.calls = append(f.calls, "acquire "+string(rune('0'+layer)))
	return map[string]*tensor.Tensor{}, nil
}
func (f *fakeServer) Release(layer int) {
	f.calls = append(f.calls, "release "+string(rune('0'+layer)))
}
func (f *fakeServer) MarkStep() int64     { return 0 }
func (f *fakeServer) Stats() paging.Stats { return paging.Stats{} }
func (f *fakeServer) Close() error        { return nil }

type pinServer struct{ fakeServer }

func (f *pinServer) PinLayer(ctx context.Context, layer int, fp []byte) ([]byte, error) {
	f.calls = append(f.calls, "pin "+string(rune('0'+layer)))
	return append(fp, byte(layer)), nil
}

// TestLayerPinner checks which weights offer PinLayer (layerPinner): a
// stage's weights exactly when their server pins, passing the stage's
// numbering of a layer to the server's, and refusing a layer not on the
// stage.
func TestLayerPinner(t *testing.T) {
	if layerPinner(StageWeights(&fakeServer{}, []int{3, 4})) != nil {
		t.Error("a stage over a server without PinLayer offers it")
	}
	if layerPinner(&HostWeights{}) != nil {
		t.Error("HostWeights offers PinLayer")
	}
	srv := &pinServer{}
	p := layerPinner(StageWeights(srv, []int{3, 4}))
	if p == nil {
		t.Fatal("a stage over a pinning server does not offer PinLayer")
	}
	fp, err := p.PinLayer(context.Background(), 4, []byte{9})
	if err != nil || string(fp) != "\x09\x01" || strings.Join(srv.calls, ",") != "pin 1" {
		t.Errorf("PinLayer(4) on a stage of layers 3, 4: %q, %v, server calls %v; want the server's layer 1 pinned", fp, err, srv.calls)
	}
	if _, err := p.PinLayer(context.Background(), 2, nil); err == nil || !strings.Contains(err.Error(), "layer 2") {
		t.Errorf("PinLayer of a layer not on the stage: %v", err)
	}
}
