package cli

import (
	"fmt"

	"github.com/strata-llm/strata/arch"
)

// Context names the model's context length and the config.json setting it
// comes from, for messages: "the model's context of 256 positions
// (max_position_embeddings)".
func Context(cfg *arch.Config) string {
	n := cfg.ContextLength()
	if n > 0 && n == cfg.SlidingWindow {
		return fmt.Sprintf("the model's sliding attention window of %d positions (sliding_window)", n)
	}
	return fmt.Sprintf("the model's context of %d positions (max_position_embeddings)", n)
}
