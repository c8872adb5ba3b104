package simengine

import (
	"math/bits"
	"sync"
)

// Token is a token id. Ids come from hashing the token's bytes (see
// Tokenize), so there is no vocabulary file and any text has ids.
type Token uint32

// BlockHash identifies a full KV-cache block together with everything before
// it: the hash of block i covers block i-1's hash and block i's tokens, as in
// vLLM, so equal blocks after different prefixes get different hashes.
type BlockHash uint64

// maxChunk is the longest run of word bytes that forms one token. With five
// bytes, English text comes out near the usual four characters per token.
const maxChunk = 5

// rootHash is the parent of a sequence's first block.
const rootHash BlockHash = 0x436f6d7075746546 // "ComputeF"

// Tokenize appends the tokens of text to dst and returns the extended slice.
//
// The rule is fixed and documented so that other tools can predict counts:
//   - "<|" followed by 1 to 32 bytes of [A-Za-z0-9_] and "|>" is one token
//     (a special token, as in chat templates: "<|im_start|>").
//   - A run of word bytes (ASCII letters, digits and every byte >= 0x80) is
//     cut into tokens of at most five bytes, from the start of the run.
//   - Every other byte that is not whitespace is a token on its own.
//   - Whitespace (space, \t, \n, \v, \f, \r) after a token belongs to that
//     token; whitespace at the very start of text is a token of its own.
//
// A token's id is the 64-bit FNV-1a hash of its bytes (whitespace included),
// folded to 32 bits. Because a token never starts with whitespace, text that
// ends in whitespace or before a special token or punctuation tokenizes the
// same alone as inside a longer text: a chat history re-sent by a client
// yields the same leading tokens the engine saw and generated.
func Tokenize(dst []Token, text string) []Token {
	i, n := 0, len(text)
	for i < n {
		start := i
		switch c := text[i]; {
		case isSpace(c):
			// only at the very start: later whitespace is absorbed below
		case c == '<' && i+1 < n && text[i+1] == '|':
			if j := specialEnd(text, i); j > 0 {
				i = j
			} else {
				i++
			}
		case isWord(c):
			for i < n && i-start < maxChunk && isWord(text[i]) {
				i++
			}
		default:
			i++
		}
		for i < n && isSpace(text[i]) {
			i++
		}
		dst = append(dst, tokenID(text[start:i]))
	}
	return dst
}

// tokenBufs holds CountTokens' buffers.
var tokenBufs = sync.Pool{New: func() any { return new([]Token) }}

// CountTokens returns len(Tokenize(nil, text)). It tokenizes into a pooled
// buffer, so it allocates nothing once warm.
func CountTokens(text string) int {
	bp := tokenBufs.Get().(*[]Token)
	*bp = Tokenize((*bp)[:0], text)
	n := len(*bp)
	if cap(*bp) <= 1<<16 {
		tokenBufs.Put(bp) // an outsized buffer is not kept
	}
	return n
}

// specialEnd returns the index just past a special token starting at i, or 0.
func specialEnd(text string, i int) int {
	j := i + 2
	for j < len(text) && j-i-2 < 32 && isIdent(text[j]) {
		j++
	}
	if j == i+2 || j+1 >= len(text) || text[j] != '|' || text[j+1] != '>' {
		return 0
	}
	return j + 2
}

func isSpace(c byte) bool { return c == ' ' || (c >= '\t' && c <= '\r') }

func isWord(c byte) bool {
	return c >= 0x80 || (c >= '0' && c <= '9') || (c|0x20 >= 'a' && c|0x20 <= 'z')
}

func isIdent(c byte) bool { return c == '_' || (c < 0x80 && isWord(c)) }

func tokenID(s string) Token {
	h := uint64(14695981039346656037)
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= 1099511628211
	}
	return Token(h ^ h>>32)
}

// BlockHashes extends dst with the hashes of the full blocks of tokens that
// dst does not cover yet: block i spans tokens[i*blockSize:(i+1)*blockSize]
// and its parent is dst[i-1]. Called with the hashes of an earlier, shorter
// turn of the same conversation, it only hashes the new blocks. A trailing
// partial block gets no hash: only full blocks are ever cached.
func BlockHashes(dst []BlockHash, tokens []Token, blockSize int) []BlockHash {
	if blockSize <= 0 {
		return dst
	}
	parent := rootHash
	if len(dst) > 0 {
		parent = dst[len(dst)-1]
	}
	for i := len(dst) * blockSize; i+blockSize <= len(tokens); i += blockSize {
		parent = chainHash(parent, tokens[i:i+blockSize])
		dst = append(dst, parent)
	}
	return dst
}

// chainHash hashes one block under its parent. It is not cryptographic: the
// simulator only needs a fast hash that rarely collides.
func chainHash(parent BlockHash, toks []Token) BlockHash {
	h := uint64(parent) ^ 0x9e3779b97f4a7c15
	for _, t := range toks {
		h = bits.RotateLeft64((h^uint64(t))*0xff51afd7ed558ccd, 29)
	}
	return BlockHash(mix64(h))
}

// mix64 is the splitmix64 finalizer.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// words is the vocabulary of generated answers and of Filler. Every word is
// at most five ASCII letters, so with its trailing space it is one token.
var words = [...]string{
	"the", "cache", "block", "token", "model", "route", "agent", "relay",
	"fast", "slow", "warm", "cold", "node", "path", "queue", "batch",
	"of", "to", "and", "in", "is", "it", "on", "for",
	"with", "as", "at", "by", "from", "this", "that", "we",
	"GPU", "peer", "hop", "key", "value", "sync", "hit", "miss",
	"load", "time", "first", "next", "turn", "chat", "user", "reply",
	"data", "link", "home", "host", "port", "send", "read", "write",
	"plan", "score", "weigh", "pick", "keep", "move", "learn", "serve",
}

// wordIDs[i] is the id of words[i] followed by one space; lastIDs[i] is the
// id of words[i] alone (the final token of an answer).
var wordIDs, lastIDs [len(words)]Token

func init() {
	for i, w := range words {
		if len(w) > maxChunk {
			panic("simengine: vocabulary word longer than one token: " + w)
		}
		wordIDs[i] = tokenID(w + " ")
		lastIDs[i] = tokenID(w)
	}
}

// Filler returns text of exactly n tokens: words of the built-in vocabulary,
// each followed by one space, drawn from a generator seeded by seed. Fillers
// concatenate without merging tokens, so Filler(a, x)+Filler(b, y) has x+y
// tokens; benchmarks use it to turn trace block ids into text.
func Filler(seed uint64, n int) string {
	if n <= 0 {
		return ""
	}
	b := make([]byte, 0, n*5)
	s := seed
	for range n {
		s += 0x9e3779b97f4a7c15
		b = append(b, words[mix64(s)%uint64(len(words))]...)
		b = append(b, ' ')
	}
	return string(b)
}

// answerWords returns the word indices of the n-token answer to the prompt
// identified by key.
func answerWords(seed, key uint64, n int) []uint8 {
	out := make([]uint8, n)
	s := mix64(seed ^ key)
	for i := range out {
		s += 0x9e3779b97f4a7c15
		out[i] = uint8(mix64(s) % uint64(len(words)))
	}
	return out
}

// answerTokens turns answer word indices into token ids: every word but the
// last carries a trailing space, so the text is words joined by spaces.
func answerTokens(idx []uint8) []Token {
	out := make([]Token, len(idx))
	for i, w := range idx {
		if i == len(idx)-1 {
			out[i] = lastIDs[w]
		} else {
			out[i] = wordIDs[w]
		}
	}
	return out
}

// answerPieces returns the text of each answer token.
func answerPieces(idx []uint8) []string {
	out := make([]string, len(idx))
	for i, w := range idx {
		if i == len(idx)-1 {
			out[i] = words[w]
		} else {
			out[i] = words[w] + " "
		}
	}
	return out
}
