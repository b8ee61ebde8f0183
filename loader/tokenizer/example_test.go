package tokenizer_test

import (
	"fmt"
	"log"

	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/loader/tokenizer"
)

func Example() {
	tok, err := tokenizer.Load(fixtures.Dir(fixtures.TinyLlamaBF16))
	if err != nil {
		log.Fatal(err)
	}
	ids, err := tok.Encode("Hello, world!", true)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(ids[0] == tok.BOS(), len(ids))

	// Decode as the ids arrive; the pieces add up to tok.Decode(ids).
	st := tok.NewStream()
	for _, id := range ids[1:] {
		piece, err := st.Add(id)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%q ", piece)
	}
	fmt.Printf("%q\n", st.Flush())
	// Output:
	// true 12
	// "" "H" "e" "ll" "o" ", " "w" "or" "l" "d" "!" ""
}
