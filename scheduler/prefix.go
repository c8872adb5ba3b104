package scheduler

import (
	"bytes"
	"unicode/utf8"
	"unsafe"

	"github.com/cespare/xxhash/v2"

	"github.com/computeflux/computeflux/scheduler/jsonscan"
)

// PrefixConfig says how a prompt is cut into blocks. The zero value of every
// field means its default.
type PrefixConfig struct {
	// BlockTokens is the number of tokens a block stands for. Default
	// DefaultBlockTokens (64): four of vLLM's 16-token blocks, fine enough
	// for routing and a quarter of the hashing, index and update traffic.
	BlockTokens int
	// BytesPerToken approximates a token's size in bytes of prompt text.
	// Default 4. A block is BlockTokens × BytesPerToken bytes of canonical
	// text (256 by default), at most MaxBlockBytes.
	BytesPerToken int
	// MaxBlocks caps the chain: a longer prompt is identified by its first
	// MaxBlocks blocks. Default DefaultMaxBlocks.
	MaxBlocks int
}

const (
	// DefaultBlockTokens is the default block size in tokens.
	DefaultBlockTokens = 64
	// DefaultBytesPerToken is the default size of a token in bytes.
	DefaultBytesPerToken = 4
	// DefaultMaxBlocks is the default chain cap: 4,096 blocks of 256 bytes
	// are 1 MiB of text, about 256K tokens.
	DefaultMaxBlocks = 4096
	// MaxBlockBytes is the largest block; larger settings are clamped.
	MaxBlockBytes = 4096
	// maxChainBlocks bounds MaxBlocks whatever the configuration.
	maxChainBlocks = 1 << 20
)

// BlockBytes returns the block size in bytes of canonical text.
func (c PrefixConfig) BlockBytes() int {
	bt, bp := c.BlockTokens, c.BytesPerToken
	if bt <= 0 {
		bt = DefaultBlockTokens
	}
	if bp <= 0 {
		bp = DefaultBytesPerToken
	}
	if bt > MaxBlockBytes || bp > MaxBlockBytes || bt*bp > MaxBlockBytes {
		return MaxBlockBytes
	}
	return bt * bp
}

func (c PrefixConfig) maxBlocks() int {
	if c.MaxBlocks <= 0 {
		return DefaultMaxBlocks
	}
	return min(c.MaxBlocks, maxChainBlocks)
}

// chainHasher cuts a byte stream into blocks and names each block by the
// xxhash64 of the whole stream up to the block's end: one running digest,
// read at every block boundary, so a block's hash names its prefix and the
// text is hashed once. It lives on the caller's stack: no allocation.
type chainHasher struct {
	dst  []uint64
	d    xxhash.Digest
	n    int // bytes in the current block
	size int // block size
	max  int // blocks still allowed
}

func (h *chainHasher) init(dst []uint64, cfg PrefixConfig) {
	h.dst, h.n, h.size, h.max = dst, 0, cfg.BlockBytes(), cfg.maxBlocks()
	h.d.Reset()
}

// full reports whether the chain has reached its cap.
func (h *chainHasher) full() bool { return h.max <= 0 }

func (h *chainHasher) write(p []byte) {
	for len(p) > 0 && h.max > 0 {
		k := min(h.size-h.n, len(p))
		_, _ = h.d.Write(p[:k])
		h.n += k
		p = p[k:]
		if h.n == h.size {
			h.dst = append(h.dst, h.d.Sum64())
			h.n = 0
			h.max--
		}
	}
}

func (h *chainHasher) writeByte(c byte) {
	b := [1]byte{c}
	h.write(b[:])
}

func (h *chainHasher) writeString(s string) {
	if h.max > 0 {
		h.write(unsafe.Slice(unsafe.StringData(s), len(s)))
	}
}

// TextBlocks appends to dst the block-hash chain of text taken as canonical
// prompt text: one hash per full block of cfg.BlockBytes() bytes (a partial
// last block is not hashed, as engines cache only full blocks), each the
// xxhash64 of the text from its start to the block's end, at most
// cfg.MaxBlocks. The
// result is the same in every process. It allocates only when dst has no
// room.
func TextBlocks(dst []uint64, text []byte, cfg PrefixConfig) []uint64 {
	var h chainHasher
	h.init(dst, cfg)
	h.write(text)
	return h.dst
}

// Markers of the canonical prompt text. PromptBlocks renders a request as
// the engine will see its prompt, in order: the tools (if any), then every
// message as
//
//	MarkRole role MarkContent content MarkEnd
//
// where content is the string content, or the text of its text parts in
// order, and each other part (an image, audio, a file) is MarkPart followed
// by the part's JSON as sent. An assistant message's tool_calls, and a
// message's name and tool_call_id, follow its content as MarkPart and their
// JSON. A completions prompt string is the canonical text as it is.
const (
	MarkRole    = 0x01
	MarkContent = 0x02
	MarkEnd     = 0x03
	MarkPart    = 0x04
	MarkTools   = 0x05
)

// PromptBlocks appends to dst the block-hash chain (see TextBlocks) of the
// prompt of an OpenAI request body: chat/completions "messages" (roles and
// content, string or content parts) with its "tools", a completions
// "prompt", or a Responses "input" (a string or message items). A body it
// cannot read as a prompt yields no blocks, and routing goes on without a
// prefix. Time and memory are bounded for any input: one pass over the
// body to find its fields and at most cfg.MaxBlocks blocks of hashing. No
// allocation when dst has room.
func PromptBlocks(dst []uint64, body []byte, cfg PrefixConfig) []uint64 {
	start := len(dst)
	var tools, msgs, prompt, input []byte
	ok := jsonscan.Object(body, func(key, val []byte) {
		switch string(key) {
		case "tools":
			tools = val
		case "messages":
			msgs = val
		case "prompt":
			prompt = val
		case "input":
			input = val
		}
	})
	if !ok {
		return dst[:start]
	}
	var h chainHasher
	h.init(dst, cfg)
	if len(tools) > 0 && tools[0] == '[' && !bytes.Equal(tools, []byte("[]")) {
		h.writeByte(MarkTools)
		h.write(tools)
		h.writeByte(MarkEnd)
	}
	switch {
	case len(msgs) > 0:
		ok = hashMessages(&h, msgs)
	case len(prompt) > 0:
		ok = hashPrompt(&h, prompt)
	case len(input) > 0:
		if input[0] == '"' {
			h.writeByte(MarkRole)
			h.writeString("user")
			h.writeByte(MarkContent)
			ok = writeJSONString(&h, input)
			h.writeByte(MarkEnd)
		} else {
			ok = hashMessages(&h, input)
		}
	default:
		ok = false
	}
	if !ok {
		return h.dst[:start]
	}
	return h.dst
}

// hashPrompt hashes a completions prompt: a string, or anything else (one
// string in an array, token ids) by its JSON.
func hashPrompt(h *chainHasher, v []byte) bool {
	if v[0] == '"' {
		return writeJSONString(h, v)
	}
	if v[0] == '[' {
		inner := bytes.TrimSpace(v[1 : len(v)-1])
		if len(inner) > 0 && inner[0] == '"' {
			if end, ok := jsonscan.SkipValue(inner, 0); ok && len(bytes.TrimSpace(inner[end:])) == 0 {
				return writeJSONString(h, inner[:end])
			}
		}
		h.write(v)
		return true
	}
	return false
}

// hashMessages hashes a messages array.
func hashMessages(h *chainHasher, v []byte) bool {
	if v[0] != '[' {
		return false
	}
	n := 0
	ok := jsonscan.Array(v, func(m []byte) bool {
		if h.full() {
			return false // the rest cannot change the chain
		}
		if m[0] != '{' {
			return false
		}
		var role, content, extra1, extra2, extra3 []byte
		if !jsonscan.Object(m, func(key, val []byte) {
			switch string(key) {
			case "role":
				role = val
			case "content":
				content = val
			case "tool_calls":
				extra1 = val
			case "name":
				extra2 = val
			case "tool_call_id":
				extra3 = val
			}
		}) {
			n = -1
			return false
		}
		n++
		h.writeByte(MarkRole)
		if len(role) > 0 && role[0] == '"' {
			if !writeJSONString(h, role) {
				n = -1
				return false
			}
		}
		h.writeByte(MarkContent)
		if !hashContent(h, content) {
			n = -1
			return false
		}
		for _, x := range [...][]byte{extra1, extra2, extra3} {
			if len(x) > 0 && !bytes.Equal(x, []byte("null")) {
				h.writeByte(MarkPart)
				h.write(x)
			}
		}
		h.writeByte(MarkEnd)
		return true
	})
	return n >= 0 && (ok || h.full())
}

// hashContent hashes a message's content: null, a string or parts.
func hashContent(h *chainHasher, v []byte) bool {
	switch {
	case len(v) == 0 || v[0] == 'n':
		return true
	case v[0] == '"':
		return writeJSONString(h, v)
	case v[0] == '[':
		bad := false
		ok := jsonscan.Array(v, func(p []byte) bool {
			if h.full() {
				return false
			}
			var typ, text []byte
			if p[0] == '{' && jsonscan.Object(p, func(key, val []byte) {
				switch string(key) {
				case "type":
					typ = val
				case "text":
					text = val
				}
			}) && len(text) > 0 && text[0] == '"' &&
				(bytes.Equal(typ, []byte(`"text"`)) || bytes.Equal(typ, []byte(`"input_text"`)) || bytes.Equal(typ, []byte(`"output_text"`))) {
				if !writeJSONString(h, text) {
					bad = true
					return false
				}
				return true
			}
			h.writeByte(MarkPart)
			h.write(p)
			return true
		})
		return !bad && (ok || h.full())
	case v[0] == '{':
		h.writeByte(MarkPart)
		h.write(v)
		return true
	}
	return false
}

// writeJSONString writes the decoded value of the JSON string literal v
// (quotes included) to h. Runs without escapes are copied in one piece.
func writeJSONString(h *chainHasher, v []byte) bool {
	if len(v) < 2 || v[0] != '"' || v[len(v)-1] != '"' {
		return false
	}
	s := v[1 : len(v)-1]
	for len(s) > 0 && !h.full() {
		i := bytes.IndexByte(s, '\\')
		if i < 0 {
			h.write(s)
			return true
		}
		h.write(s[:i])
		s = s[i:]
		if len(s) < 2 {
			return false
		}
		switch c := s[1]; c {
		case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			h.writeByte(jsonUnescape[c])
			s = s[2:]
		case 'u':
			r, ok := hex4(s[2:])
			if !ok {
				return false
			}
			s = s[6:]
			if r >= 0xd800 && r < 0xdc00 && len(s) >= 6 && s[0] == '\\' && s[1] == 'u' {
				if r2, ok := hex4(s[2:]); ok && r2 >= 0xdc00 && r2 < 0xe000 {
					r = 0x10000 + (r-0xd800)<<10 + (r2 - 0xdc00)
					s = s[6:]
				}
			}
			var b [4]byte
			n := utf8.EncodeRune(b[:], r)
			h.write(b[:n])
		default:
			return false
		}
	}
	return true
}

// jsonUnescape maps the byte after a backslash to the byte it stands for,
// for JSON's one-character escapes.
var jsonUnescape = [256]byte{'"': '"', '\\': '\\', '/': '/', 'b': '\b', 'f': '\f', 'n': '\n', 'r': '\r', 't': '\t'}

func hex4(s []byte) (rune, bool) {
	if len(s) < 4 {
		return 0, false
	}
	var r rune
	for _, c := range s[:4] {
		switch {
		case c >= '0' && c <= '9':
			r = r<<4 | rune(c-'0')
		case c >= 'a' && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case c >= 'A' && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return 0, false
		}
	}
	return r, true
}

// CachedBlocks converts an engine's usage answer into blocks of a chain of
// chainLen blocks: the engine reports promptTokens tokens of which
// cachedTokens were served from its cache; the chain covers about
// chainLen+½ blocks of the same prompt. The result is in 0..chainLen.
func CachedBlocks(chainLen, promptTokens, cachedTokens int) int {
	if chainLen <= 0 || promptTokens <= 0 || cachedTokens <= 0 {
		return 0
	}
	if cachedTokens >= promptTokens {
		return chainLen
	}
	n := int((float64(cachedTokens) * (float64(chainLen) + 0.5)) / float64(promptTokens))
	return min(max(n, 0), chainLen)
}
