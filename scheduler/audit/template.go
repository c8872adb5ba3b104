package audit

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"math/rand/v2"
	"strconv"
	"strings"
	"unicode/utf8"
)

// A Template is the form of one client's chat request with every byte the
// client wrote taken out: Capture keeps the fields in their order, the
// numbers and flags (sampling parameters, max_tokens, stream options), the
// roles and the number and length of messages, the structure of tools and
// schemas, the JSON's formatting; it replaces message texts by their
// length, identifiers (tool and property names) by a number, other strings
// by their shape (letters, digits, punctuation). Fill writes a request of
// that form with made-up text, so that an audit carries what the model's
// traffic carries and nothing a client wrote.
type Template struct {
	root *node
	// Sampled is true unless the request decodes greedily (temperature
	// 0): sampled answers compare only under a shared seed.
	Sampled bool
	// Stream is the request's stream flag.
	Stream bool
	// MaxTokens is its max_tokens (or max_completion_tokens); 0 when unset.
	MaxTokens int
	// Messages is the number of messages; PromptBytes the bytes of their
	// text.
	Messages, PromptBytes int
	// Seeded is true when the client set its own seed.
	Seeded bool

	colonSpace, commaSpace bool // the client's separators: ": " and ", "
	asciiOnly              bool // the client escapes non-ASCII text (\u00e9)
	idents, callIDs        int  // distinct identifiers and tool call IDs
}

// Fill kinds of a string in a template.
const (
	fillKeep   = iota // the string as it was: enums, types, roles
	fillText          // made-up text of about n bytes
	fillIdent         // a made-up identifier, the same for the same number
	fillShape         // a string of the same shape
	fillArgs          // tool call arguments: a JSON object, filled in turn
	fillCallID        // a tool call ID of the same shape, the same for the same number
)

type node struct {
	kind byte // '{', '[', '"' (string) or 'v' (number, true, false, null: raw)
	keys []*node
	kids []*node
	raw  []byte // 'v', and '"' kept as it was (fillKeep): the JSON
	fill int
	n    int    // fillText: bytes; fillIdent: the identifier's number
	mask []byte // fillShape, fillCallID: see shapeMask
	args *node  // fillArgs: the arguments' object
}

// Limits of Capture: a request beyond them is not used as a template.
const (
	maxTemplateDepth = 32
	maxTemplateNodes = 4096
)

// ErrNotTemplate is Capture's answer for a request it does not take as a
// template: not a chat request, media in it, or too large.
var ErrNotTemplate = errors.New("audit: request cannot serve as a template")

// Capture reads a chat completions request body into a Template. pseudonym,
// if not nil, maps the values of the identity fields (user,
// safety_identifier) to what the template keeps, as the relay sends them
// to agents; with nil they are kept as shapes. texts, if not nil, is
// called with each message's text (Phrases.Observe reads them); the
// template keeps only their lengths.
func Capture(body []byte, pseudonym func(string) string, texts func(string)) (*Template, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	c := capturer{dec: dec, t: &Template{Sampled: true}, pseudonym: pseudonym, texts: texts, ids: map[string]int{}, callIDs: map[string]int{}}
	root, err := c.value(0, ctxTop)
	if err != nil {
		return nil, err
	}
	if root.kind != '{' || c.t.Messages == 0 {
		return nil, ErrNotTemplate
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, ErrNotTemplate
	}
	c.t.root = root
	c.t.colonSpace, c.t.commaSpace, c.t.asciiOnly = separators(body)
	c.t.idents, c.t.callIDs = len(c.ids), len(c.callIDs)
	return c.t, nil
}

// Contexts of a value in a chat request, which say how its strings fill.
const (
	ctxTop      = iota // the body
	ctxAny             // anything else: strings keep their shape
	ctxMessages        // the messages array
	ctxMessage         // one message
	ctxContent         // a message's content (a string or parts)
	ctxPart            // one content part
	ctxToolCall        // one tool call of an assistant message
	ctxFunction        // {name, arguments} of a tool call, or {name} of tool_choice
	ctxTools           // the tools array
	ctxTool            // one tool
	ctxToolFunc        // a tool's function: name, description, parameters
	ctxSchema          // a JSON schema
	ctxProps           // a schema's properties: keys are identifiers
	ctxIdents          // an array of identifiers (required)
	ctxFormat          // response_format
	ctxKeep            // strings kept as they are (stop, modalities)
	ctxDesc            // a description: made-up text, not counted as prompt
	ctxArgs            // tool call arguments: keys are identifiers
	ctxCallID          // a tool call's ID: the same made-up ID for the same ID
)

type capturer struct {
	dec       *json.Decoder
	t         *Template
	pseudonym func(string) string
	texts     func(string)
	ids       map[string]int // identifier -> its number; dropped with the capturer
	callIDs   map[string]int // tool call ID -> its number; dropped with the capturer
	nodes     int
}

func (c *capturer) ident(s string) int {
	n, ok := c.ids[s]
	if !ok {
		n = len(c.ids)
		c.ids[s] = n
	}
	return n
}

func (c *capturer) value(depth, ctx int) (*node, error) {
	if depth > maxTemplateDepth {
		return nil, ErrNotTemplate
	}
	if c.nodes++; c.nodes > maxTemplateNodes {
		return nil, ErrNotTemplate
	}
	tok, err := c.dec.Token()
	if err != nil {
		return nil, ErrNotTemplate
	}
	switch v := tok.(type) {
	case json.Delim:
		if v == '{' {
			return c.object(depth, ctx)
		}
		if v == '[' {
			return c.array(depth, ctx)
		}
		return nil, ErrNotTemplate
	case string:
		return c.str(v, ctx), nil
	case json.Number:
		return &node{kind: 'v', raw: []byte(v.String())}, nil
	case bool:
		return &node{kind: 'v', raw: []byte(strconv.FormatBool(v))}, nil
	case nil:
		return &node{kind: 'v', raw: []byte("null")}, nil
	}
	return nil, ErrNotTemplate
}

func (c *capturer) str(s string, ctx int) *node {
	switch ctx {
	case ctxKeep, ctxFunction:
		// ctxFunction: tool_choice as a string ("auto", "required").
		return keep(s)
	case ctxContent:
		c.t.PromptBytes += len(s)
		if c.texts != nil {
			c.texts(s)
		}
		return &node{kind: '"', fill: fillText, n: len(s)}
	case ctxDesc:
		return &node{kind: '"', fill: fillText, n: len(s)}
	case ctxIdents:
		return &node{kind: '"', fill: fillIdent, n: c.ident(s)}
	case ctxCallID:
		n, ok := c.callIDs[s]
		if !ok {
			n = len(c.callIDs)
			c.callIDs[s] = n
		}
		return &node{kind: '"', fill: fillCallID, n: n, mask: callIDMask(s)}
	}
	return &node{kind: '"', fill: fillShape, mask: shapeMask(s)}
}

func keep(s string) *node {
	b, _ := json.Marshal(s)
	return &node{kind: '"', raw: b}
}

// fieldContext says how the value of a field of an object in context ctx
// fills.
func fieldContext(ctx int, key string) int {
	switch ctx {
	case ctxTop:
		switch key {
		case "messages":
			return ctxMessages
		case "tools":
			return ctxTools
		case "tool_choice":
			return ctxFunction // a string choice ("auto") is kept
		case "response_format":
			return ctxFormat
		case "model", "stop", "modalities", "service_tier", "reasoning_effort", "verbosity", "logit_bias":
			return ctxKeep
		case "stream_options":
			return ctxKeep
		}
	case ctxMessage:
		switch key {
		case "role":
			return ctxKeep
		case "content", "refusal", "reasoning_content":
			return ctxContent
		case "tool_calls":
			return ctxToolCall
		case "tool_call_id":
			return ctxCallID
		}
	case ctxContent, ctxPart:
		switch key {
		case "type":
			return ctxKeep
		case "text":
			return ctxContent
		}
	case ctxToolCall:
		switch key {
		case "id":
			return ctxCallID
		case "type":
			return ctxKeep
		case "function":
			return ctxFunction
		}
	case ctxTool:
		switch key {
		case "type":
			return ctxKeep
		case "function":
			return ctxToolFunc
		}
	case ctxFunction, ctxToolFunc:
		switch key {
		case "type":
			return ctxKeep
		case "name":
			return ctxIdents
		case "function":
			return ctxFunction
		case "description":
			return ctxDesc
		case "parameters":
			return ctxSchema
		}
	case ctxFormat:
		switch key {
		case "type":
			return ctxKeep
		case "json_schema":
			return ctxToolFunc
		case "schema":
			return ctxSchema
		}
	case ctxSchema:
		switch key {
		case "properties", "$defs", "definitions", "patternProperties":
			return ctxProps
		case "required":
			return ctxIdents
		case "description", "title":
			return ctxDesc
		case "type", "format", "$ref", "pattern", "additionalProperties":
			return ctxKeep
		case "enum", "examples", "default", "const":
			return ctxAny
		}
		return ctxSchema
	case ctxProps:
		return ctxSchema
	case ctxArgs:
		return ctxAny
	case ctxKeep:
		return ctxKeep
	}
	return ctxAny
}

func (c *capturer) object(depth, ctx int) (*node, error) {
	n := &node{kind: '{'}
	for c.dec.More() {
		tok, err := c.dec.Token()
		if err != nil {
			return nil, ErrNotTemplate
		}
		key, _ := tok.(string)
		// Keys are the API's field names and kept, but for identifiers
		// (a schema's property names) and a client's own map keys.
		var kn *node
		switch ctx {
		case ctxProps, ctxArgs:
			kn = &node{kind: '"', fill: fillIdent, n: c.ident(key)}
		case ctxAny:
			kn = &node{kind: '"', fill: fillShape, mask: shapeMask(key)}
		default:
			kn = keep(key)
		}
		sub := fieldContext(ctx, key)
		if ctx == ctxTop {
			if err := c.top(key); err != nil {
				return nil, err
			}
		}
		var v *node
		switch {
		case ctx == ctxTop && (key == "user" || key == "safety_identifier"):
			v, err = c.identity(depth)
		case ctx == ctxFunction && key == "arguments":
			v, err = c.arguments(depth)
		case (ctx == ctxContent || ctx == ctxPart) && key == "type":
			v, err = c.partType(depth)
		default:
			v, err = c.value(depth+1, sub)
		}
		if err != nil {
			return nil, err
		}
		if ctx == ctxTop {
			c.topValue(key, v)
		}
		n.keys, n.kids = append(n.keys, kn), append(n.kids, v)
	}
	if _, err := c.dec.Token(); err != nil {
		return nil, ErrNotTemplate
	}
	return n, nil
}

// top notes a top-level field before its value is read.
func (c *capturer) top(key string) error {
	switch key {
	case "prompt", "audio", "prediction", "functions", "function_call":
		// Not a chat request this auditor writes (legacy functions,
		// audio, predicted outputs).
		return ErrNotTemplate
	case "seed":
		c.t.Seeded = true
	}
	return nil
}

// topValue notes what the auditor needs of a top-level field's value.
func (c *capturer) topValue(key string, v *node) {
	if v.kind != 'v' {
		return
	}
	switch key {
	case "temperature":
		if f, err := strconv.ParseFloat(string(v.raw), 64); err == nil && f == 0 {
			c.t.Sampled = false
		}
	case "max_tokens", "max_completion_tokens":
		if n, err := strconv.Atoi(string(v.raw)); err == nil && n > 0 {
			c.t.MaxTokens = n
		}
	case "stream":
		c.t.Stream = string(v.raw) == "true"
	}
}

// partType keeps a content part's type, and refuses media: an audit
// cannot make up an image.
func (c *capturer) partType(depth int) (*node, error) {
	v, err := c.value(depth+1, ctxKeep)
	if err != nil {
		return nil, err
	}
	if v.kind == '"' && !bytes.Equal(v.raw, []byte(`"text"`)) {
		return nil, ErrNotTemplate
	}
	return v, nil
}

// identity reads user or safety_identifier: the value agents get, its
// pseudonym; its shape when there is no pseudonym.
func (c *capturer) identity(depth int) (*node, error) {
	tok, err := c.dec.Token()
	if err != nil {
		return nil, ErrNotTemplate
	}
	switch v := tok.(type) {
	case string:
		if c.pseudonym != nil {
			return keep(c.pseudonym(v)), nil
		}
		return &node{kind: '"', fill: fillShape, mask: shapeMask(v)}, nil
	case nil:
		return &node{kind: 'v', raw: []byte("null")}, nil
	}
	return nil, ErrNotTemplate
}

func (c *capturer) arguments(depth int) (*node, error) {
	tok, err := c.dec.Token()
	if err != nil {
		return nil, ErrNotTemplate
	}
	s, ok := tok.(string)
	if !ok {
		return nil, ErrNotTemplate
	}
	sub := capturer{dec: json.NewDecoder(bytes.NewReader([]byte(s))), t: &Template{}, ids: c.ids, callIDs: c.callIDs, nodes: c.nodes}
	sub.dec.UseNumber()
	args, err := sub.value(depth+1, ctxArgs)
	c.nodes = sub.nodes
	if err != nil || args.kind != '{' {
		return &node{kind: '"', fill: fillShape, mask: shapeMask(s)}, nil
	}
	// Argument names are the tool's property names: the same identifiers.
	return &node{kind: '"', fill: fillArgs, args: args}, nil
}

func (c *capturer) array(depth, ctx int) (*node, error) {
	n := &node{kind: '['}
	sub := ctx
	switch ctx {
	case ctxMessages:
		sub = ctxMessage
	case ctxTools:
		sub = ctxTool
	case ctxContent:
		sub = ctxPart
	}
	for c.dec.More() {
		v, err := c.value(depth+1, sub)
		if err != nil {
			return nil, err
		}
		if ctx == ctxMessages {
			c.t.Messages++
		}
		n.kids = append(n.kids, v)
	}
	if _, err := c.dec.Token(); err != nil {
		return nil, ErrNotTemplate
	}
	return n, nil
}

// callIDPrefixes are the prefixes engines give tool call IDs: kept, so
// that a made-up ID looks like one its engine wrote.
var callIDPrefixes = []string{"chatcmpl-tool-", "call_", "call-", "toolu_", "fc_"}

func callIDMask(s string) []byte {
	for _, p := range callIDPrefixes {
		if rest, ok := strings.CutPrefix(s, p); ok {
			return append([]byte(p), shapeMask(rest)...)
		}
	}
	return shapeMask(s)
}

// Classes of a shape mask: any other byte of a mask stands for itself.
const (
	maskLower = 1 + iota
	maskUpper
	maskDigit
	maskHex
)

// shapeMask returns s with letters, digits and hex digits replaced by
// their class: a string of the same shape can be made from it, and
// nothing else. A hex string (a UUID, a digest) stays hex; other
// characters stay, but for control characters (a space) and non-ASCII
// ones (a lower-case letter).
func shapeMask(s string) []byte {
	hex := len(s) > 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' || c == '-') {
			hex = false
			break
		}
	}
	m := make([]byte, 0, len(s))
	for _, r := range s {
		switch {
		case r >= '0' && r <= '9':
			m = append(m, maskDigit)
		case hex && (r >= 'a' && r <= 'f' || r >= 'A' && r <= 'F'):
			m = append(m, maskHex)
		case r >= 'a' && r <= 'z' || r >= utf8.RuneSelf:
			m = append(m, maskLower)
		case r >= 'A' && r <= 'Z':
			m = append(m, maskUpper)
		case r < 0x20:
			m = append(m, ' ')
		default:
			m = append(m, byte(r))
		}
	}
	return m
}

// Shaped returns a string of s's shape drawn from rng: each digit a digit,
// each letter a letter of its case (hex stays hex), anything else kept.
func Shaped(s string, rng *rand.Rand) string { return string(fromMask(shapeMask(s), rng)) }

func fromMask(m []byte, rng *rand.Rand) []byte {
	out := make([]byte, len(m))
	for i, c := range m {
		switch c {
		case maskDigit:
			out[i] = '0' + byte(rng.IntN(10))
		case maskHex:
			out[i] = "0123456789abcdef"[rng.IntN(16)]
		case maskLower:
			out[i] = 'a' + byte(rng.IntN(26))
		case maskUpper:
			out[i] = 'A' + byte(rng.IntN(26))
		default:
			out[i] = c
		}
	}
	return out
}

// separators reads the client's JSON formatting outside strings: a space
// after ':' and after ',', and whether non-ASCII text is escaped.
func separators(b []byte) (colonSpace, commaSpace, asciiOnly bool) {
	in, esc := false, false
	seenColon, seenComma := false, false
	asciiOnly = true
	for i, c := range b {
		if c >= utf8.RuneSelf {
			asciiOnly = false
		}
		switch {
		case in && esc:
			esc = false
		case in && c == '\\':
			esc = true
		case c == '"':
			in = !in
		case !in && c == ':' && !seenColon:
			seenColon = true
			colonSpace = i+1 < len(b) && b[i+1] == ' '
		case !in && c == ',' && !seenComma:
			seenComma = true
			commaSpace = i+1 < len(b) && b[i+1] == ' '
		}
	}
	return colonSpace, commaSpace, asciiOnly
}

// TextSource makes up what a filled template says.
type TextSource interface {
	// Text returns about n bytes of text.
	Text(n int, rng *rand.Rand) string
	// Ident returns an identifier (a tool or property name).
	Ident(rng *rand.Rand) string
}

// Fill writes a request of the template's form for model, its texts and
// identifiers from src, its shaped strings from rng.
func (t *Template) Fill(model string, src TextSource, rng *rand.Rand) []byte {
	f := filler{t: t, src: src, rng: rng, model: model, ids: make([]string, t.idents), callIDs: make([]string, t.callIDs)}
	f.value(t.root, true)
	return f.b.Bytes()
}

type filler struct {
	t     *Template
	src   TextSource
	rng   *rand.Rand
	model string
	ids   []string
	b     bytes.Buffer
	// callIDs are the made-up tool call IDs by number.
	callIDs []string
}

func (f *filler) ident(n int) string {
	if n < 0 || n >= len(f.ids) {
		return f.src.Ident(f.rng)
	}
	if f.ids[n] == "" {
		f.ids[n] = f.src.Ident(f.rng)
	}
	return f.ids[n]
}

func (f *filler) sep(c byte, space bool) {
	f.b.WriteByte(c)
	if space {
		f.b.WriteByte(' ')
	}
}

func (f *filler) value(n *node, top bool) {
	switch n.kind {
	case '{':
		f.b.WriteByte('{')
		for i, k := range n.keys {
			if i > 0 {
				f.sep(',', f.t.commaSpace)
			}
			f.value(k, false)
			f.sep(':', f.t.colonSpace)
			if top && bytes.Equal(k.raw, []byte(`"model"`)) {
				f.str(f.model)
				continue
			}
			f.value(n.kids[i], false)
		}
		f.b.WriteByte('}')
	case '[':
		f.b.WriteByte('[')
		for i, k := range n.kids {
			if i > 0 {
				f.sep(',', f.t.commaSpace)
			}
			f.value(k, false)
		}
		f.b.WriteByte(']')
	case 'v':
		f.b.Write(n.raw)
	case '"':
		switch n.fill {
		case fillKeep:
			f.b.Write(n.raw)
		case fillText:
			f.str(f.src.Text(n.n, f.rng))
		case fillIdent:
			f.str(f.ident(n.n))
		case fillShape:
			f.str(string(fromMask(n.mask, f.rng)))
		case fillCallID:
			if n.n >= len(f.callIDs) {
				f.str(string(fromMask(n.mask, f.rng)))
				break
			}
			if f.callIDs[n.n] == "" {
				f.callIDs[n.n] = string(fromMask(n.mask, f.rng))
			}
			f.str(f.callIDs[n.n])
		case fillArgs:
			inner := filler{t: &Template{}, src: f.src, rng: f.rng, ids: f.ids, callIDs: f.callIDs}
			inner.value(n.args, false)
			f.str(inner.b.String())
		}
	}
}

// str writes s as a JSON string the way the client's encoder would: no
// HTML escapes, non-ASCII escaped only when the client escaped it.
func (f *filler) str(s string) {
	const hexd = "0123456789abcdef"
	f.b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			f.b.WriteByte('\\')
			f.b.WriteByte(byte(r))
		case r == '\n':
			f.b.WriteString(`\n`)
		case r == '\r':
			f.b.WriteString(`\r`)
		case r == '\t':
			f.b.WriteString(`\t`)
		case r < 0x20 || (f.t.asciiOnly && r >= utf8.RuneSelf):
			for _, u := range utf16Of(r) {
				f.b.WriteString(`\u`)
				f.b.WriteByte(hexd[u>>12&0xf])
				f.b.WriteByte(hexd[u>>8&0xf])
				f.b.WriteByte(hexd[u>>4&0xf])
				f.b.WriteByte(hexd[u&0xf])
			}
		default:
			f.b.WriteRune(r)
		}
	}
	f.b.WriteByte('"')
}

func utf16Of(r rune) []uint16 {
	if r < 0x10000 {
		return []uint16{uint16(r)}
	}
	r -= 0x10000
	return []uint16{uint16(0xd800 + (r >> 10)), uint16(0xdc00 + (r & 0x3ff))}
}

// SetFields returns body (a JSON object) with the values of the top-level
// string fields in values replaced, and the rest byte for byte: an audit
// sends each participant the user its own traffic names, which no engine
// decodes by. Fields body lacks are not added; body is returned as it is
// when it is not an object.
func SetFields(body []byte, values map[string]string) []byte {
	if len(values) == 0 {
		return body
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return body
	}
	type span struct {
		start, end int
		v          string
	}
	var spans []span
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return body
		}
		key, _ := t.(string)
		start := int(dec.InputOffset())
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return body
		}
		end := int(dec.InputOffset())
		if v, ok := values[key]; ok && len(raw) > 0 && raw[0] == '"' {
			// InputOffset is past the separator before the value: find
			// the value itself.
			start += bytes.IndexByte(body[start:end], '"')
			spans = append(spans, span{start, end, v})
		}
	}
	out := make([]byte, 0, len(body)+32)
	i := 0
	for _, sp := range spans {
		out = append(out, body[i:sp.start]...)
		var q bytes.Buffer
		enc := json.NewEncoder(&q)
		enc.SetEscapeHTML(false) // as the relay forwards identity fields
		_ = enc.Encode(sp.v)
		out = append(out, bytes.TrimSuffix(q.Bytes(), []byte("\n"))...)
		i = sp.end
	}
	return append(out, body[i:]...)
}
