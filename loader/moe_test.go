package loader

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader/fixtures"
)

// TestOpenMoEFixtures opens the mixtures of experts: every sparse block is
// one layer holding the router and each expert's three matrices, which
// arch names by role and expert; nothing in the files is left over.
func TestOpenMoEFixtures(t *testing.T) {
	for _, name := range []string{fixtures.TinyMixtralBF16, fixtures.TinyQwen3MoEF16} {
		t.Run(name, func(t *testing.T) {
			m, err := Open(fixtures.Dir(name))
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			c := m.Config
			if c.MoE == nil || len(m.Extras()) != 0 {
				t.Fatalf("MoE %+v, extras %v", c.MoE, m.Extras())
			}
			for _, l := range m.Layers() {
				if l.Kind != arch.Block {
					continue
				}
				experts := map[int]int{}
				var bytes int64
				for _, ti := range l.Tensors {
					bytes += ti.Size
				}
				for _, s := range c.LayerTensors(l.Index) {
					if s.Role.IsExpert() {
						experts[s.Expert]++
					}
				}
				if len(experts) != c.MoE.Experts || bytes != l.Bytes || len(l.Tensors) != len(c.LayerTensors(l.Index)) {
					t.Errorf("layer %d: %d experts, %d tensors, %d bytes (%d counted)", l.Index, len(experts), len(l.Tensors), l.Bytes, bytes)
				}
				for e, n := range experts {
					if n != 3 {
						t.Errorf("layer %d expert %d has %d tensors", l.Index, e, n)
					}
				}
			}
		})
	}
}

// TestMoEMismatch: weights that do not match a mixture-of-experts config
// (experts missing, a config with more experts than the files, routing
// fields strata does not run) are refused with the tensor or the field
// named, and the file.
func TestMoEMismatch(t *testing.T) {
	for _, tc := range []struct {
		name    string
		fixture string
		edit    func(t *testing.T, dir string)
		kind    error
		want    []string
	}{
		{"more experts than the files hold", fixtures.TinyMixtralBF16, func(t *testing.T, dir string) {
			editConfig(t, dir, func(c map[string]any) { c["num_local_experts"] = 10 })
		}, ErrMismatch, []string{"model.layers.0.block_sparse_moe.gate.weight", "has shape [8, 64], the config needs [10, 64]", "more problems"}},
		{"an expert's matrix missing", fixtures.TinyQwen3MoEF16, func(t *testing.T, dir string) {
			removeTensor(t, dir, "model.layers.1.mlp.experts.11.down_proj.weight")
		}, ErrMismatch, []string{"model.layers.1.mlp.experts.11.down_proj.weight", "missing"}},
		{"other expert sizes", fixtures.TinyQwen3MoEF16, func(t *testing.T, dir string) {
			editConfig(t, dir, func(c map[string]any) { c["moe_intermediate_size"] = 40 })
		}, ErrMismatch, []string{"model.layers.0.mlp.experts.0.gate_proj.weight", "has shape [48, 64], the config needs [40, 64]"}},
		{"dense blocks the files do not have", fixtures.TinyQwen3MoEF16, func(t *testing.T, dir string) {
			editConfig(t, dir, func(c map[string]any) { c["mlp_only_layers"] = []int{2} })
		}, ErrMismatch, []string{"model.layers.2.mlp.gate_proj.weight", "missing"}},
		{"sigmoid routing", fixtures.TinyQwen3MoEF16, func(t *testing.T, dir string) {
			editConfig(t, dir, func(c map[string]any) { c["scoring_func"] = "sigmoid" })
		}, ErrConfig, []string{"config.json", `scoring_func "sigmoid" is not supported`}},
		{"grouped routing", fixtures.TinyMixtralBF16, func(t *testing.T, dir string) {
			editConfig(t, dir, func(c map[string]any) { c["topk_method"] = "group_limited_greedy" })
		}, ErrConfig, []string{"config.json", `topk_method "group_limited_greedy"`}},
		{"qwen3 without q/k norms in the files", fixtures.TinyQwen3F16, func(t *testing.T, dir string) {
			removeTensor(t, dir, "model.layers.3.self_attn.k_norm.weight")
		}, ErrMismatch, []string{"model.layers.3.self_attn.k_norm.weight", "missing"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), tc.fixture)
			if err := os.CopyFS(dir, os.DirFS(fixtures.Dir(tc.fixture))); err != nil {
				t.Fatal(err)
			}
			tc.edit(t, dir)
			m, err := Open(dir)
			if err == nil {
				m.Close()
				t.Fatal("Open succeeded")
			}
			if !errors.Is(err, tc.kind) {
				t.Errorf("error %q is not %v", err, tc.kind)
			}
			msg := err.Error()
			for _, w := range tc.want {
				if !strings.Contains(msg, w) {
					t.Errorf("error %q does not mention %q", msg, w)
				}
			}
			if strings.ContainsAny(msg, "\r\n") {
				t.Errorf("error %q is more than one line", msg)
			}
		})
	}
}

// removeTensor deletes the named tensor from its shard's header and from
// the index of the sharded model in dir.
func removeTensor(t *testing.T, dir, name string) {
	t.Helper()
	rewrite(t, filepath.Join(dir, shardOf(t, dir, name)), func(h map[string]any) { delete(h, name) })
	editIndex(t, dir, func(wm map[string]string) { delete(wm, name) })
}
