package main

import (
	"errors"
	"fmt"

	"github.com/strata-llm/strata/nn"
)

// forwardError words a forward's *nn.NonFiniteError for the command line,
// placing it in the prompt of promptLen tokens or among the generated
// tokens; other errors are returned as they are.
func forwardError(err error, promptLen int) error {
	var ne *nn.NonFiniteError
	if !errors.As(err, &ne) {
		return err
	}
	where := fmt.Sprintf("prompt position %d", ne.Pos)
	if ne.Pos >= promptLen {
		where = fmt.Sprintf("generated token %d (position %d)", ne.Pos-promptLen+1, ne.Pos)
	}
	return fmt.Errorf("non-finite values (%v) first appear in the output of %s (layer %d) at %s", ne.Value, ne.Name, ne.Layer, where)
}
