package loader

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/internal/filetest"
	"github.com/strata-llm/strata/loader/fixtures"
)

// TestOpenRefusesNonRegular: a model file that is a named pipe (opening it
// would block until a writer came), a directory or a device is refused at
// once with one line naming it.
func TestOpenRefusesNonRegular(t *testing.T) {
	kinds := []struct {
		name string
		make func(t *testing.T, path string)
	}{
		{"named pipe", func(t *testing.T, p string) { filetest.Mkfifo(t, p) }},
		{"directory", func(t *testing.T, p string) { os.Mkdir(p, 0o755) }},
		{"device", func(t *testing.T, p string) {
			if err := os.Symlink("/dev/zero", p); err != nil {
				t.Skip("no symlinks here:", err)
			}
		}},
	}
	files := []struct {
		name    string
		sharded bool
		file    func(t *testing.T, dir string) string
	}{
		{"config", false, func(*testing.T, string) string { return ConfigFile }},
		{"single file", false, func(*testing.T, string) string { return SingleFile }},
		{"index", true, func(*testing.T, string) string { return IndexFile }},
		{"shard", true, func(t *testing.T, dir string) string { return shardOf(t, dir, arch.EmbedName) }},
	}
	for _, f := range files {
		for _, k := range kinds {
			t.Run(f.name+"/"+k.name, func(t *testing.T) {
				dir := tinyModel(t, f.sharded)
				name := f.file(t, dir)
				p := filepath.Join(dir, name)
				os.Remove(p)
				k.make(t, p)
				done := make(chan error, 1)
				go func() {
					m, err := Open(dir)
					if err == nil {
						m.Close()
					}
					done <- err
				}()
				select {
				case err := <-done:
					if !errors.Is(err, ErrNotRegular) || !strings.Contains(err.Error(), p) || strings.Contains(err.Error(), "\n") {
						t.Fatalf("Open: %v; want one line naming %s as not a regular file", err, p)
					}
				case <-time.After(10 * time.Second):
					t.Fatalf("Open hangs on %s", k.name)
				}
			})
		}
	}
}

// noReadAt hides a file system's ReadAt, as a plain fs.FS has none.
type noReadAt struct{ fs.FS }

func (n noReadAt) Open(name string) (fs.File, error) {
	f, err := n.FS.Open(name)
	if err != nil {
		return nil, err
	}
	return struct{ fs.File }{f}, nil
}

// TestOpenFS: the embedded fixtures open in place, with the tensors, bytes
// and layers of the same models opened from the source tree, whether the
// file system's files have ReadAt or not; InputFiles lists every file a
// directory model reads and nothing for an embedded one.
func TestOpenFS(t *testing.T) {
	ctx := context.Background()
	for _, name := range []string{fixtures.TinyLlamaBF16, fixtures.TinyLlamaF16Sharded} {
		for _, fsys := range []fs.FS{fixtures.FS(), noReadAt{fixtures.FS()}} {
			emb, err := OpenFS(fsys, name)
			if err != nil {
				t.Fatal(err)
			}
			disk := openFixture(t, name)
			if emb.Dir != name || len(emb.Layers()) != len(disk.Layers()) || emb.WeightBytes() != disk.WeightBytes() {
				t.Errorf("%s: embedded %s, %d layers, %d bytes; on disk %d layers, %d bytes",
					name, emb.Dir, len(emb.Layers()), emb.WeightBytes(), len(disk.Layers()), disk.WeightBytes())
			}
			for _, ti := range disk.Tensors() {
				a, err := emb.ReadTensor(ctx, ti.Name)
				if err != nil {
					t.Fatal(err)
				}
				b, _ := disk.ReadTensor(ctx, ti.Name)
				if !bytes.Equal(a.Bytes(), b.Bytes()) {
					t.Fatalf("%s: %s differs embedded", name, ti.Name)
				}
			}
			if tj, err := fs.ReadFile(emb.FS(), TokenizerFile); err != nil || len(tj) == 0 {
				t.Errorf("%s: tokenizer through FS(): %v", name, err)
			}
			if in := emb.InputFiles(); in != nil {
				t.Errorf("embedded model lists input files %v", in)
			}
			want := []string{ConfigFile, "generation_config.json", TokenizerFile, TokenizerConfig}
			want = append(want, disk.Files()...)
			if len(disk.Files()) > 1 {
				want = append(want, IndexFile)
			}
			var got []string
			for _, p := range disk.InputFiles() {
				if filepath.Dir(p) != disk.Dir {
					t.Errorf("input file %s is not in %s", p, disk.Dir)
				}
				got = append(got, filepath.Base(p))
			}
			slices.Sort(got)
			slices.Sort(want)
			if !slices.Equal(got, want) {
				t.Errorf("%s: InputFiles %v, want %v", name, got, want)
			}
			emb.Close()
			if _, err := emb.ReadTensor(ctx, arch.EmbedName); !errors.Is(err, ErrClosed) {
				t.Errorf("read after Close: %v", err)
			}
		}
	}
	if _, err := OpenFS(fixtures.FS(), "../x"); err == nil {
		t.Error("OpenFS accepted ../x")
	}
	if _, err := OpenFS(fixtures.FS(), "none"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("OpenFS of a missing model: %v", err)
	}
}
