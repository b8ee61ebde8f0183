package tokenizer

import (
	"fmt"
	"sync"
	"unicode/utf8"
)

// Word cache limits, the same as the Hugging Face BPE model's: results for
// words up to maxCachedWord bytes are kept until cacheCapacity are held.
const (
	cacheCapacity = 10000
	maxCachedWord = 256
)

// merge is the value of one entry in the merge table: its rank (lower merges
// first) and the id of the merged token.
type merge struct {
	rank int32
	id   int32
}

// bpeModel is a byte pair encoding model: a vocabulary and a ranked list of
// merges, applied to one pre-token word at a time.
type bpeModel struct {
	vocab        map[string]int
	merges       map[uint64]merge
	unk          string // "" when the model has no unknown token
	fuseUnk      bool
	byteFallback bool
	ignoreMerges bool
	prefix       string // continuing_subword_prefix
	suffix       string // end_of_word_suffix
	byteIDs      [256]int

	mu    sync.RWMutex
	cache map[string][]int
}

func pairKey(a, b int) uint64 { return uint64(uint32(a))<<32 | uint64(uint32(b)) }

// symbol is one token of a word being merged. Merged-away symbols keep their
// slot with size 0; prev and next link the live ones.
type symbol struct {
	id         int
	prev, next int
	size       int
}

// candidate is a possible merge at position pos, queued by rank then position.
type candidate struct {
	rank int32
	id   int32
	pos  int
}

func (c candidate) less(d candidate) bool {
	if c.rank != d.rank {
		return c.rank < d.rank
	}
	return c.pos < d.pos
}

// mergeQueue is a binary min-heap of candidates.
type mergeQueue []candidate

func (q *mergeQueue) push(c candidate) {
	h := append(*q, c)
	i := len(h) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !h[i].less(h[p]) {
			break
		}
		h[i], h[p] = h[p], h[i]
		i = p
	}
	*q = h
}

func (q *mergeQueue) pop() candidate {
	h := *q
	top := h[0]
	n := len(h) - 1
	h[0] = h[n]
	h = h[:n]
	i := 0
	for {
		l, r, m := 2*i+1, 2*i+2, i
		if l < n && h[l].less(h[m]) {
			m = l
		}
		if r < n && h[r].less(h[m]) {
			m = r
		}
		if m == i {
			break
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
	*q = h
	return top
}

// encode appends the ids of word to dst.
func (m *bpeModel) encode(dst []int, word string) ([]int, error) {
	return m.encodeBytes(dst, nil, word)
}

// encodeBytes is encode for a word given as bytes (b, when word is ""):
// a word found in the cache or the vocabulary costs no allocation.
func (m *bpeModel) encodeBytes(dst []int, b []byte, word string) ([]int, error) {
	if word == "" && len(b) == 0 {
		return dst, nil
	}
	if m.ignoreMerges {
		id, ok := m.vocab[word]
		if b != nil {
			id, ok = m.vocab[string(b)]
		}
		if ok {
			return append(dst, id), nil
		}
	}
	cacheable := len(word) < maxCachedWord && len(b) < maxCachedWord
	if cacheable {
		m.mu.RLock()
		ids, ok := m.cache[word]
		if b != nil {
			ids, ok = m.cache[string(b)]
		}
		m.mu.RUnlock()
		if ok {
			return append(dst, ids...), nil
		}
	}
	if b != nil {
		word = string(b)
	}
	ids, err := m.mergeWord(word)
	if err != nil {
		return dst, err
	}
	if cacheable {
		m.mu.Lock()
		if len(m.cache) < cacheCapacity {
			m.cache[word] = ids
		}
		m.mu.Unlock()
	}
	return append(dst, ids...), nil
}

// mergeWord splits word into characters, looks each up (falling back to byte
// tokens or the unknown token), then applies merges lowest rank first, the
// leftmost one among equal ranks.
func (m *bpeModel) mergeWord(word string) ([]int, error) {
	syms := make([]symbol, 0, len(word))
	add := func(id, size int) {
		n := len(syms)
		if n > 0 {
			syms[n-1].next = n
		}
		syms = append(syms, symbol{id: id, prev: n - 1, next: -1, size: size})
	}
	unkID, unkSize := -1, 0
	for i := 0; i < len(word); {
		_, size := utf8.DecodeRuneInString(word[i:])
		s := word[i : i+size]
		first, last := i == 0, i+size == len(word)
		i += size
		if !first && m.prefix != "" {
			s = m.prefix + s
		}
		if last && m.suffix != "" {
			s += m.suffix
		}
		if id, ok := m.vocab[s]; ok {
			if unkID >= 0 {
				add(unkID, unkSize)
				unkID = -1
			}
			add(id, size)
			continue
		}
		if m.byteFallback && m.allBytesKnown(s) {
			for j := 0; j < len(s); j++ {
				add(m.byteIDs[s[j]], 1)
			}
			continue
		}
		if m.unk == "" {
			continue // no unknown token: the character is dropped
		}
		id, ok := m.vocab[m.unk]
		if !ok {
			return nil, fmt.Errorf("tokenizer: encode: unknown token %q is not in the vocabulary", m.unk)
		}
		switch {
		case unkID >= 0 && m.fuseUnk:
			unkSize += size
		case unkID >= 0:
			add(unkID, unkSize)
			unkSize = size
		default:
			unkID, unkSize = id, size
		}
	}
	if unkID >= 0 {
		add(unkID, unkSize)
	}

	var q mergeQueue
	for i := 0; i+1 < len(syms); i++ {
		if mg, ok := m.merges[pairKey(syms[i].id, syms[i+1].id)]; ok {
			q = append(q, candidate{rank: mg.rank, id: mg.id, pos: i})
		}
	}
	for i := len(q)/2 - 1; i >= 0; i-- { // heapify
		siftDown(q, i)
	}
	for len(q) > 0 {
		top := q.pop()
		cur := &syms[top.pos]
		if cur.size == 0 || cur.next == -1 {
			continue
		}
		nextPos := cur.next
		right := syms[nextPos]
		mg, ok := m.merges[pairKey(cur.id, right.id)]
		if !ok || mg.id != top.id {
			continue // stale: the pair changed since it was queued
		}
		cur.id = int(top.id)
		cur.size += right.size
		cur.next = right.next
		syms[nextPos].size = 0
		if right.next >= 0 {
			syms[right.next].prev = top.pos
		}
		if cur.prev >= 0 {
			if mg, ok := m.merges[pairKey(syms[cur.prev].id, cur.id)]; ok {
				q.push(candidate{rank: mg.rank, id: mg.id, pos: cur.prev})
			}
		}
		if cur.next >= 0 {
			if mg, ok := m.merges[pairKey(cur.id, syms[cur.next].id)]; ok {
				q.push(candidate{rank: mg.rank, id: mg.id, pos: top.pos})
			}
		}
	}
	ids := make([]int, 0, len(syms))
	for _, s := range syms {
		if s.size != 0 {
			ids = append(ids, s.id)
		}
	}
	return ids, nil
}

func siftDown(h mergeQueue, i int) {
	n := len(h)
	for {
		l, r, m := 2*i+1, 2*i+2, i
		if l < n && h[l].less(h[m]) {
			m = l
		}
		if r < n && h[r].less(h[m]) {
			m = r
		}
		if m == i {
			return
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
}

func (m *bpeModel) allBytesKnown(s string) bool {
	for j := 0; j < len(s); j++ {
		if m.byteIDs[s[j]] < 0 {
			return false
		}
	}
	return true
}
