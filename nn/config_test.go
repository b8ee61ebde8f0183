package nn

import (
	"errors"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/tensor"
)

// TestNewConfig checks that New and NewPipeline take the config arch
// validates, refuse what arch refuses, and keep a copy of their own.
func TestNewConfig(t *testing.T) {
	b := tensor.NewCPU(1)
	defer b.Close()
	tiny, err := arch.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	noFamily := tiny.Clone()
	noFamily.Family = 0
	oddHead := tiny.Clone()
	oddHead.HeadDim = 15
	window := tiny.Clone()
	window.SlidingWindow = 8 // llama has none
	for _, tc := range []struct {
		name string
		cfg  *arch.Config
		want string
	}{
		{"nil", nil, "nn: no config"},
		{"no family", noFamily, "unsupported family"},
		{"odd head dim", oddHead, "head_dim 15 must be even"},
		{"llama with a sliding window", window, "llama has no sliding window"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.cfg, b, nil, nil)
			_, perr := NewPipeline(tc.cfg, []Stage{{Backend: b, FirstBlock: 0, EndBlock: tiny.NumLayers}})
			for _, e := range []error{err, perr} {
				if e == nil || !strings.Contains(e.Error(), tc.want) {
					t.Errorf("%v, want an error naming %q", e, tc.want)
				}
				if tc.cfg != nil && !errors.Is(e, arch.ErrConfig) {
					t.Errorf("%v does not wrap arch.ErrConfig", e)
				}
			}
		})
	}

	cfg := tiny.Clone()
	m, err := New(cfg, b, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewPipeline(cfg, []Stage{{Backend: b, FirstBlock: 0, EndBlock: cfg.NumLayers}})
	if err != nil {
		t.Fatal(err)
	}
	cfg.VocabSize, cfg.EOS[0] = 7, 5
	for what, got := range map[string]*arch.Config{"model": m.Config(), "pipeline": p.Config()} {
		if got.VocabSize != tiny.VocabSize || got.EOS[0] != tiny.EOS[0] {
			t.Errorf("%s: the caller's later change shows in its config: vocab %d, eos %v", what, got.VocabSize, got.EOS)
		}
		got.NumLayers = 1
	}
	if m.Config().NumLayers != tiny.NumLayers || p.Config().NumLayers != tiny.NumLayers || m.NumLayers() != tiny.NumLayers+2 {
		t.Errorf("a change to Config's result shows in the model")
	}
}
