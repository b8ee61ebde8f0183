package loader

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader/fixtures"
)

// TestOpenErrorsCloseFiles damages a sharded model in ways found at
// different points of Open (the index, the first shard, the last shard, a
// tensor check after every shard is open, a config naming more blocks than
// stored) and checks that each failed Open leaves no file open.
func TestOpenErrorsCloseFiles(t *testing.T) {
	const k1 = "model.layers.1.self_attn.k_proj.weight"
	cases := map[string]func(t *testing.T, dir string){
		"index names a missing shard": func(t *testing.T, dir string) {
			os.Remove(filepath.Join(dir, shardOf(t, dir, k1)))
		},
		"first shard corrupt": func(t *testing.T, dir string) {
			os.WriteFile(filepath.Join(dir, shardOf(t, dir, arch.EmbedName)), []byte("not a safetensors file"), 0o644)
		},
		"last shard corrupt": func(t *testing.T, dir string) {
			os.WriteFile(filepath.Join(dir, shardOf(t, dir, arch.LMHeadName)), []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, '{', '}'}, 0o644)
		},
		"tensor missing after every shard opened": func(t *testing.T, dir string) {
			shard := filepath.Join(dir, shardOf(t, dir, k1))
			rewrite(t, shard, func(h map[string]any) { h["renamed"] = h[k1]; delete(h, k1) })
			editIndex(t, dir, func(wm map[string]string) { wm["renamed"] = wm[k1]; delete(wm, k1) })
		},
		"index points at the wrong shard": func(t *testing.T, dir string) {
			editIndex(t, dir, func(wm map[string]string) { wm[k1] = wm[arch.EmbedName] })
		},
		"config claims a million blocks": func(t *testing.T, dir string) {
			editConfig(t, dir, func(c map[string]any) { c["num_hidden_layers"] = 1 << 20 })
		},
	}
	for name, damage := range cases {
		t.Run(name, func(t *testing.T) {
			dir := tinyModel(t, true)
			damage(t, dir)
			before := openFiles(t)
			m, err := Open(dir)
			if err == nil {
				m.Close()
				t.Fatal("Open succeeded")
			}
			if !strings.HasPrefix(err.Error(), "loader: ") {
				t.Errorf("error %q lacks the package prefix", err)
			}
			if after := openFiles(t); after != before {
				t.Errorf("failed Open (%v) left %d files open", err, after-before)
			}
		})
	}
}

// TestModelDamagedAfterOpen reads tensors after their shard was truncated,
// restored and replaced under the open model, and after Close.
func TestModelDamagedAfterOpen(t *testing.T) {
	dir, err := fixtures.Extract(fixtures.TinyLlamaF16Sharded, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	before := openFiles(t)
	m, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	const name = "model.layers.2.mlp.down_proj.weight"
	ti, _ := m.Tensor(name)
	want, err := m.ReadTensor(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	shard := filepath.Join(dir, ti.File)
	orig, err := os.ReadFile(shard)
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(shard, 0o644)

	// Truncated in place: an error naming the file and tensor, wrapping
	// io.ErrUnexpectedEOF; a range before the cut still reads.
	if err := os.Truncate(shard, ti.Offset+ti.Size/2); err != nil {
		t.Fatal(err)
	}
	_, err = m.ReadTensor(ctx, name)
	if !errors.Is(err, io.ErrUnexpectedEOF) || !strings.Contains(err.Error(), shard) || !strings.Contains(err.Error(), name) {
		t.Errorf("read of a truncated shard: %v; want io.ErrUnexpectedEOF naming %s and %s", err, shard, name)
	}
	head := make([]byte, 64)
	if err := m.ReadRange(ctx, ti, 0, head); err != nil || !bytes.Equal(head, want.Bytes()[:64]) {
		t.Errorf("range before the cut: %v", err)
	}
	// Restored in place: reads work again.
	if err := os.WriteFile(shard, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	if got, err := m.ReadTensor(ctx, name); err != nil || !bytes.Equal(got.Bytes(), want.Bytes()) {
		t.Errorf("after restoring the shard: %v", err)
	}
	// Replaced by rename: the open model reads the file it opened.
	tmp := shard + ".tmp"
	if err := os.WriteFile(tmp, make([]byte, 100), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, shard); err != nil {
		t.Fatal(err)
	}
	if got, err := m.ReadTensor(ctx, name); err != nil || !bytes.Equal(got.Bytes(), want.Bytes()) {
		t.Errorf("after replacing the shard: %v", err)
	}
	// A range outside the tensor never reaches the file.
	for _, r := range [][2]int64{{-1, 2}, {ti.Size, 1}, {ti.Size - 1, 2}, {1 << 62, 1 << 20}} {
		err := m.ReadRange(ctx, ti, r[0], make([]byte, r[1]))
		if !errors.Is(err, ErrMismatch) {
			t.Errorf("ReadRange(%d, %d bytes) of a %d-byte tensor: %v, want ErrMismatch", r[0], r[1], ti.Size, err)
		}
	}
	// A cancelled context stops a read.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := m.ReadTensor(cctx, name); !errors.Is(err, context.Canceled) {
		t.Errorf("read with a cancelled context: %v", err)
	}
	// Close: idempotent, files closed, reads fail clearly.
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if after := openFiles(t); after != before {
		t.Errorf("%d files open after Close", after-before)
	}
	if _, err := m.ReadTensor(ctx, name); !errors.Is(err, ErrClosed) {
		t.Errorf("read after Close: %v, want ErrClosed", err)
	}
}
