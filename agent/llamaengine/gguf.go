package llamaengine

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
)

// Defaults for the zero values of ModelConfig.
const (
	DefaultEmbed   = 64   // hidden size: a few hundred kB of weights, fast on any CPU
	DefaultLayers  = 2    // enough for the answer to depend on the whole prompt
	DefaultHeads   = 4    // head size 16
	DefaultFF      = 128  // feed-forward width, 2x the hidden size
	DefaultContext = 4096 // trained context length the engine may use
)

// ModelConfig describes a tiny random-weight llama model. Two configs that
// differ only in Seed are two different models under the same shape; the
// same config always writes the same bytes.
type ModelConfig struct {
	// Seed selects the weights. Any value, zero included, is a seed.
	Seed uint64
	// Name is general.name. If empty, it is "computeflux-tiny-<seed>".
	Name string
	// Embed, Layers, Heads, FF and Context are the model's shape. Zero
	// means the Default of the same name. Embed must be a multiple of
	// Heads.
	Embed, Layers, Heads, FF, Context int
}

func (c *ModelConfig) populate() error {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.Embed, DefaultEmbed)
	def(&c.Layers, DefaultLayers)
	def(&c.Heads, DefaultHeads)
	def(&c.FF, DefaultFF)
	def(&c.Context, DefaultContext)
	if c.Name == "" {
		c.Name = fmt.Sprintf("computeflux-tiny-%d", c.Seed)
	}
	switch {
	case c.Embed < 8 || c.Layers < 1 || c.Heads < 1 || c.FF < 1 || c.Context < 16:
		return fmt.Errorf("llamaengine: model shape %dx%d, %d heads, ff %d, context %d: too small", c.Layers, c.Embed, c.Heads, c.FF, c.Context)
	case c.Embed%c.Heads != 0:
		return fmt.Errorf("llamaengine: embed %d is not a multiple of heads %d", c.Embed, c.Heads)
	}
	return nil
}

// The vocabulary: llama's three special tokens, the 256 byte tokens of
// SentencePiece byte fallback ("<0x41>"), then one token per printable
// ASCII character, "▁" standing for the space as SentencePiece writes it.
// Text tokenizes one character per token; only the printable tokens can be
// generated (see WriteModel), so answers are readable ASCII.
const (
	tokUnknown   = 0
	tokBOS       = 1
	tokEOS       = 2
	firstByteTok = 3
	firstTextTok = firstByteTok + 256
)

// GGUF token types (llama.cpp's llama_token_type).
const (
	tokTypeNormal  = 1
	tokTypeUnknown = 2
	tokTypeControl = 3
	tokTypeByte    = 6
)

// vocab returns the tokens, their scores and their types.
func vocab() (tokens []string, scores []float32, types []int32) {
	add := func(s string, score float32, typ int32) {
		tokens, scores, types = append(tokens, s), append(scores, score), append(types, typ)
	}
	add("<unk>", 0, tokTypeUnknown)
	add("<s>", 0, tokTypeControl)
	add("</s>", 0, tokTypeControl)
	for b := range 256 {
		add(fmt.Sprintf("<0x%02X>", b), 0, tokTypeByte)
	}
	add("\u2581", -1, tokTypeNormal)
	for c := byte('!'); c <= '~'; c++ {
		add(string(c), -1, tokTypeNormal)
	}
	return tokens, scores, types
}

// WriteModelFile writes the model of cfg to path as a GGUF file.
func WriteModelFile(path string, cfg ModelConfig) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := WriteModel(f, cfg); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// WriteModel writes a tiny llama model with random weights drawn from
// cfg.Seed as a GGUF v3 file: the header, the llama.* and tokenizer.ggml.*
// metadata llama.cpp needs to load it, the tensor infos, and the F32
// tensor data aligned to 32 bytes.
//
// The weights are random but shaped so that the model generates printable
// text and never ends early: every token embedding carries a large constant
// in dimension 0, which no layer writes to (the rows of attn_output and
// ffn_down for dimension 0 are zero), and the output rows of the byte and
// special tokens weigh dimension 0 strongly negative. Greedy decoding
// therefore picks among the printable tokens, by what the layers made of
// the prompt in the other dimensions.
func WriteModel(w io.Writer, cfg ModelConfig) error {
	if err := cfg.populate(); err != nil {
		return err
	}
	tokens, scores, types := vocab()
	nv, ne, nf := len(tokens), cfg.Embed, cfg.FF
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x67677566))
	normal := func(n int, std float64) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = float32(rng.NormFloat64() * std)
		}
		return v
	}
	ones := func(n int) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = 1
		}
		return v
	}
	// zeroRow0 clears the first row of a [in, out] matrix: the layer's
	// contribution to output dimension 0.
	zeroRow0 := func(m []float32, in int) []float32 {
		clear(m[:in])
		return m
	}

	var ts []tensor
	embd := normal(nv*ne, 1)
	for t := range nv {
		embd[t*ne] = 4
	}
	ts = append(ts, tensor{"token_embd.weight", []uint64{uint64(ne), uint64(nv)}, embd})
	for l := range cfg.Layers {
		p := fmt.Sprintf("blk.%d.", l)
		in := 1 / math.Sqrt(float64(ne))
		ts = append(ts,
			tensor{p + "attn_norm.weight", []uint64{uint64(ne)}, ones(ne)},
			tensor{p + "attn_q.weight", []uint64{uint64(ne), uint64(ne)}, normal(ne*ne, in)},
			tensor{p + "attn_k.weight", []uint64{uint64(ne), uint64(ne)}, normal(ne*ne, in)},
			tensor{p + "attn_v.weight", []uint64{uint64(ne), uint64(ne)}, normal(ne*ne, in)},
			tensor{p + "attn_output.weight", []uint64{uint64(ne), uint64(ne)}, zeroRow0(normal(ne*ne, in), ne)},
			tensor{p + "ffn_norm.weight", []uint64{uint64(ne)}, ones(ne)},
			tensor{p + "ffn_gate.weight", []uint64{uint64(ne), uint64(nf)}, normal(ne*nf, in)},
			tensor{p + "ffn_up.weight", []uint64{uint64(ne), uint64(nf)}, normal(ne*nf, in)},
			tensor{p + "ffn_down.weight", []uint64{uint64(nf), uint64(ne)}, zeroRow0(normal(nf*ne, 1/math.Sqrt(float64(nf))), nf)},
		)
	}
	out := normal(nv*ne, 1.5)
	for t := range nv {
		row := out[t*ne : (t+1)*ne]
		if t < firstTextTok {
			clear(row)
			row[0] = -20
		} else {
			row[0] = 0
		}
	}
	ts = append(ts,
		tensor{"output_norm.weight", []uint64{uint64(ne)}, ones(ne)},
		tensor{"output.weight", []uint64{uint64(ne), uint64(nv)}, out},
	)

	kv := []metaKV{
		{"general.architecture", "llama"},
		{"general.name", cfg.Name},
		{"general.alignment", uint32(ggufAlignment)},
		{"llama.context_length", uint32(cfg.Context)},
		{"llama.embedding_length", uint32(ne)},
		{"llama.block_count", uint32(cfg.Layers)},
		{"llama.feed_forward_length", uint32(nf)},
		{"llama.rope.dimension_count", uint32(ne / cfg.Heads)},
		{"llama.attention.head_count", uint32(cfg.Heads)},
		{"llama.attention.head_count_kv", uint32(cfg.Heads)},
		{"llama.attention.layer_norm_rms_epsilon", float32(1e-5)},
		{"llama.vocab_size", uint32(nv)},
		{"tokenizer.ggml.model", "llama"},
		{"tokenizer.ggml.tokens", tokens},
		{"tokenizer.ggml.scores", scores},
		{"tokenizer.ggml.token_type", types},
		{"tokenizer.ggml.bos_token_id", uint32(tokBOS)},
		{"tokenizer.ggml.eos_token_id", uint32(tokEOS)},
		{"tokenizer.ggml.unknown_token_id", uint32(tokUnknown)},
		{"tokenizer.ggml.add_bos_token", true},
		{"tokenizer.ggml.add_eos_token", false},
	}
	bw := bufio.NewWriter(w)
	if err := writeGGUF(bw, kv, ts); err != nil {
		return err
	}
	return bw.Flush()
}

// ggufAlignment is general.alignment: tensor data offsets are multiples of it.
const ggufAlignment = 32

// GGUF metadata value types.
const (
	ggufUint8   = 0
	ggufInt32   = 5
	ggufUint32  = 4
	ggufFloat32 = 6
	ggufBool    = 7
	ggufString  = 8
	ggufArray   = 9
)

// ggmlTypeF32 is ggml_type GGML_TYPE_F32.
const ggmlTypeF32 = 0

type metaKV struct {
	key   string
	value any // string, uint32, int32, float32, bool, []string, []float32, []int32
}

type tensor struct {
	name string
	dims []uint64 // ne0 first: ne0 is the contiguous dimension
	data []float32
}

// errWriter remembers the first write error so that the encoder stays flat.
type errWriter struct {
	w   io.Writer
	n   int64
	err error
}

func (e *errWriter) write(v any) {
	if e.err != nil {
		return
	}
	e.err = binary.Write(e.w, binary.LittleEndian, v)
	if e.err == nil {
		e.n += int64(binary.Size(v))
	}
}

func (e *errWriter) str(s string) {
	e.write(uint64(len(s)))
	if e.err == nil {
		var n int
		n, e.err = io.WriteString(e.w, s)
		e.n += int64(n)
	}
}

func (e *errWriter) pad() {
	if r := e.n % ggufAlignment; r != 0 {
		e.write(make([]byte, ggufAlignment-r))
	}
}

func writeGGUF(w io.Writer, kv []metaKV, ts []tensor) error {
	e := &errWriter{w: w}
	e.write([]byte("GGUF"))
	e.write(uint32(3))
	e.write(uint64(len(ts)))
	e.write(uint64(len(kv)))
	for _, m := range kv {
		e.str(m.key)
		switch v := m.value.(type) {
		case string:
			e.write(uint32(ggufString))
			e.str(v)
		case uint32:
			e.write(uint32(ggufUint32))
			e.write(v)
		case int32:
			e.write(uint32(ggufInt32))
			e.write(v)
		case float32:
			e.write(uint32(ggufFloat32))
			e.write(v)
		case bool:
			e.write(uint32(ggufBool))
			var b uint8
			if v {
				b = 1
			}
			e.write(b)
		case []string:
			e.write(uint32(ggufArray))
			e.write(uint32(ggufString))
			e.write(uint64(len(v)))
			for _, s := range v {
				e.str(s)
			}
		case []float32:
			e.write(uint32(ggufArray))
			e.write(uint32(ggufFloat32))
			e.write(uint64(len(v)))
			e.write(v)
		case []int32:
			e.write(uint32(ggufArray))
			e.write(uint32(ggufInt32))
			e.write(uint64(len(v)))
			e.write(v)
		default:
			return fmt.Errorf("llamaengine: metadata %s: type %T has no GGUF encoding", m.key, v)
		}
	}
	var off uint64
	for _, t := range ts {
		e.str(t.name)
		e.write(uint32(len(t.dims)))
		e.write(t.dims)
		e.write(uint32(ggmlTypeF32))
		e.write(off)
		off += alignUp(uint64(len(t.data)) * 4)
	}
	e.pad()
	for _, t := range ts {
		e.write(t.data)
		e.pad()
	}
	if e.err != nil {
		return fmt.Errorf("llamaengine: write gguf: %w", e.err)
	}
	return nil
}

func alignUp(n uint64) uint64 {
	return (n + ggufAlignment - 1) / ggufAlignment * ggufAlignment
}

// ErrNotGGUF is returned by ReadHeader for data that does not start with
// the GGUF magic.
var ErrNotGGUF = errors.New("llamaengine: not a GGUF file")

// Header is what ReadHeader decodes of a GGUF file: its version, metadata
// and tensor infos (not the tensor data).
type Header struct {
	Version  uint32
	Metadata map[string]any // string, uint32, int32, float32, bool, uint8, or []any
	Tensors  []TensorInfo
}

// TensorInfo is one tensor's entry in a GGUF header.
type TensorInfo struct {
	Name   string
	Dims   []uint64
	Type   uint32
	Offset uint64
}

// Limits on what ReadHeader accepts, so that a corrupt count cannot make
// it allocate without bound.
const (
	maxHeaderItems = 1 << 20
	maxStringLen   = 1 << 20
	maxDims        = 4
)

// ReadHeader decodes the header of a GGUF v2 or v3 file: enough to check
// what WriteModel wrote, or what a model file claims to be.
func ReadHeader(r io.Reader) (Header, error) {
	d := &decoder{r: bufio.NewReader(r)}
	var magic [4]byte
	d.read(&magic)
	if d.err == nil && string(magic[:]) != "GGUF" {
		return Header{}, ErrNotGGUF
	}
	h := Header{Metadata: map[string]any{}}
	d.read(&h.Version)
	if d.err == nil && (h.Version < 2 || h.Version > 3) {
		return Header{}, fmt.Errorf("llamaengine: GGUF version %d, want 2 or 3", h.Version)
	}
	var nt, nkv uint64
	d.read(&nt)
	d.read(&nkv)
	if d.err == nil && (nt > maxHeaderItems || nkv > maxHeaderItems) {
		return Header{}, fmt.Errorf("llamaengine: GGUF header claims %d tensors and %d keys", nt, nkv)
	}
	for i := uint64(0); i < nkv && d.err == nil; i++ {
		k := d.str()
		var typ uint32
		d.read(&typ)
		h.Metadata[k] = d.value(typ, 0)
	}
	for i := uint64(0); i < nt && d.err == nil; i++ {
		ti := TensorInfo{Name: d.str()}
		var n uint32
		d.read(&n)
		if n > maxDims {
			d.fail(fmt.Errorf("tensor %q has %d dimensions", ti.Name, n))
			break
		}
		ti.Dims = make([]uint64, n)
		d.read(ti.Dims)
		d.read(&ti.Type)
		d.read(&ti.Offset)
		h.Tensors = append(h.Tensors, ti)
	}
	if d.err != nil {
		return Header{}, fmt.Errorf("llamaengine: read gguf: %w", d.err)
	}
	return h, nil
}

type decoder struct {
	r   io.Reader
	err error
}

func (d *decoder) fail(err error) {
	if d.err == nil {
		d.err = err
	}
}

func (d *decoder) read(v any) {
	if d.err == nil {
		d.fail(binary.Read(d.r, binary.LittleEndian, v))
	}
}

func (d *decoder) str() string {
	var n uint64
	d.read(&n)
	if d.err != nil {
		return ""
	}
	if n > maxStringLen {
		d.fail(fmt.Errorf("string of %d bytes", n))
		return ""
	}
	b := make([]byte, n)
	d.read(b)
	return string(b)
}

func (d *decoder) value(typ uint32, depth int) any {
	switch typ {
	case ggufUint8:
		var v uint8
		d.read(&v)
		return v
	case ggufUint32:
		var v uint32
		d.read(&v)
		return v
	case ggufInt32:
		var v int32
		d.read(&v)
		return v
	case ggufFloat32:
		var v float32
		d.read(&v)
		return v
	case ggufBool:
		var v uint8
		d.read(&v)
		return v != 0
	case ggufString:
		return d.str()
	case ggufArray:
		var et uint32
		var n uint64
		d.read(&et)
		d.read(&n)
		if depth > 0 || n > maxHeaderItems {
			d.fail(fmt.Errorf("array of %d (nesting %d)", n, depth))
			return nil
		}
		out := make([]any, 0, min(n, 1024))
		for i := uint64(0); i < n && d.err == nil; i++ {
			out = append(out, d.value(et, depth+1))
		}
		return out
	}
	d.fail(fmt.Errorf("metadata type %d not read here", typ))
	return nil
}
