package loader_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
)

func ExampleOpen() {
	m, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		log.Fatal(err)
	}
	defer m.Close()
	c := m.Config
	fmt.Printf("%s: %d layers, hidden %d, %d heads (%d KV), %v in %d files\n",
		c.Family.Architecture(), c.NumLayers, c.HiddenSize, c.NumHeads, c.NumKVHeads, c.DType, len(m.Files()))
	for _, l := range m.Layers() {
		fmt.Printf("%-9s %2d tensors %6d bytes\n", l, len(l.Tensors), l.Bytes)
	}
	q, err := m.ReadTensor(context.Background(), "model.layers.0.self_attn.q_proj.weight")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(q)
	// Output:
	// LlamaForCausalLM: 4 layers, hidden 64, 4 heads (2 KV), F16 in 22 files
	// embedding  1 tensors  65536 bytes
	// block 0    9 tensors  90880 bytes
	// block 1    9 tensors  90880 bytes
	// block 2    9 tensors  90880 bytes
	// block 3    9 tensors  90880 bytes
	// head       2 tensors  65664 bytes
	// Tensor(F16 [64, 64] host)
}

func ExampleSynthesize() {
	dir, err := os.MkdirTemp("", "synth")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	cfg, err := arch.Preset("tiny")
	if err != nil {
		log.Fatal(err)
	}
	cfg.SetFamily(arch.Qwen2)
	cfg.TieEmbeddings = true
	m, err := loader.SynthesizeOpen(context.Background(), dir, cfg, loader.SynthOptions{Seed: 1, MaxShardBytes: 100_000})
	if err != nil {
		log.Fatal(err)
	}
	defer m.Close()
	fmt.Println(m.Config.Family, len(m.Files()), "files,", m.WeightBytes(), "bytes")
	for _, ti := range m.Layers()[1].Tensors[:3] {
		fmt.Println(ti.Name, ti.Shape)
	}
	// Output:
	// qwen2 5 files, 430208 bytes
	// model.layers.0.input_layernorm.weight [64]
	// model.layers.0.self_attn.q_proj.weight [64, 64]
	// model.layers.0.self_attn.q_proj.bias [64]
}
