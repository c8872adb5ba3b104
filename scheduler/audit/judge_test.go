package audit

import (
	"net/netip"
	"strconv"
	"strings"
	"testing"
)

// Answers of three different "models" to one audit prompt.
var (
	honest = Answer{Text: "The quick brown fox jumps over the lazy dog and runs into the woods."}
	liar   = Answer{Text: "A slow green turtle walks under the busy bridge and swims away."}
	other  = Answer{Text: "Once upon a time there was a princess who lived in a tall tower."}
)

// round builds participants from "name=answer" specs: answer is h
// (honest), l (liar), o (other), e (empty); a name starting with '*' is
// trusted, with '!' suspect; "@g" after the name puts it in group g,
// "~0.5" gives its weight and "#k" its engine kind (in that order).
func round(specs ...string) []Participant {
	var out []Participant
	for _, s := range specs {
		name, ans, _ := strings.Cut(s, "=")
		p := Participant{}
		p.Trusted = strings.HasPrefix(name, "*")
		p.Suspect = strings.HasPrefix(name, "!")
		name = strings.TrimLeft(name, "*!")
		name, p.Kind, _ = strings.Cut(name, "#")
		name, w, _ := strings.Cut(name, "~")
		if w != "" {
			p.Weight, _ = strconv.ParseFloat(w, 64)
		}
		p.Agent, p.Group, _ = strings.Cut(name, "@")
		switch ans {
		case "h":
			p.Answer = honest
		case "l":
			p.Answer = liar
		case "o":
			p.Answer = other
		}
		out = append(out, p)
	}
	return out
}

func TestJudge(t *testing.T) {
	tests := []struct {
		name  string
		parts []Participant
		rules Rules
		// want: agent -> outcome letter (a agree, d disagree, i inconclusive)
		want    string
		byRef   bool
		against map[string]string
	}{
		{name: "one liar among three honest", parts: round("h1=h", "h2=h", "h3=h", "l=l"), want: "h1:a h2:a h3:a l:d", against: map[string]string{"l": "h1"}},
		{name: "all honest", parts: round("h1=h", "h2=h", "h3=h", "h4=h"), want: "h1:a h2:a h3:a h4:a"},
		{name: "liar among two honest: two voices convict", parts: round("h1=h", "h2=h", "l=l"), want: "h1:a h2:a l:d"},
		{name: "liar among two honest, three voices asked for", parts: round("h1=h", "h2=h", "l=l"), rules: Rules{MinVoices: 3}, want: "h1:a h2:a l:i"},
		{name: "one against one decides nothing", parts: round("h=h", "l=l"), want: "h:i l:i"},
		{name: "two independent liars outvote one honest agent", parts: round("h=h", "l1=l", "l2=l"), want: "h:d l1:a l2:a"},
		{name: "two liars of one network are one voice", parts: round("h=h", "l1@net=l", "l2@net=l"), want: "h:i l1:i l2:i"},
		{name: "three liars of one network beside two honest lose", parts: round("h1=h", "h2=h", "l1@net=l", "l2@net=l", "l3@net=l"), want: "h1:a h2:a l1:d l2:d l3:d"},
		{name: "new voices weigh little against tenured ones", parts: round("h=h", "l1~0.2=l", "l2~0.2=l"), want: "h:i l1:i l2:i"},
		{name: "tenured voices convict a new liar", parts: round("h1=h", "h2=h", "l~0.2=l"), want: "h1:a h2:a l:d"},
		{name: "two against two is a standoff", parts: round("h1=h", "h2=h", "l1=l", "l2=l"), want: "h1:i h2:i l1:i l2:i"},
		{name: "two liars with one honest and a reference", parts: round("h=h", "l1=l", "l2=l", "*ref=h"), want: "h:a l1:d l2:d", byRef: true, against: map[string]string{"l1": "ref"}},
		{name: "the reference outweighs a consensus", parts: round("h1=h", "h2=h", "h3=h", "l=l", "*ref=l"), want: "h1:d h2:d h3:d l:a", byRef: true},
		{name: "two references split", parts: round("a=h", "*r1=h", "*r2=l"), want: "a:i", byRef: true},
		{name: "liars of different kinds do not add up", parts: round("h=h", "l=l", "o1=o", "x=e"), want: "h:i l:i o1:i x:i"},
		{name: "suspect is judged but not a reference", parts: round("h1=h", "h2=h", "h3=h", "!q=l"), want: "h1:a h2:a h3:a q:d"},
		{name: "suspects do not vote", parts: round("h1=h", "!q1=l", "!q2=l", "!q3=l"), want: "h1:i q1:i q2:i q3:i"},
		{name: "alone", parts: round("a=h"), want: "a:i"},
		{name: "empty answers are inconclusive against empty", parts: round("a=e", "b=e", "c=e", "d=e"), want: "a:i b:i c:i d:i"},
		{name: "empty answer among honest", parts: round("h1=h", "h2=h", "h3=h", "x=e"), want: "h1:a h2:a h3:a x:d"},
		{name: "sampled: other kinds do not compare", parts: round("h1#vllm=h", "h2#vllm=h", "l#llama=l"), rules: Rules{Sampled: true}, want: "h1:a h2:a l:i"},
		{name: "sampled: a liar of the voices' kind is convicted", parts: round("h1#vllm=h", "h2#vllm=h", "l#vllm=l", "x#llama=h"), rules: Rules{Sampled: true}, want: "h1:a h2:a l:d x:i"},
		{name: "greedy: kinds compare", parts: round("h1#vllm=h", "h2#vllm=h", "l#llama=l"), want: "h1:a h2:a l:d"},
		{name: "sampled: a reference of another kind does not judge", parts: round("h1#vllm=h", "h2#vllm=h", "l#vllm=l", "*ref#llama=l"), rules: Rules{Sampled: true}, want: "h1:a h2:a l:d"},
	}
	letter := map[Outcome]string{Agree: "a", Disagree: "d", Inconclusive: "i"}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			vs := Judge(tc.parts, tc.rules)
			var got []string
			for _, v := range vs {
				got = append(got, v.Agent+":"+letter[v.Outcome])
				if v.ByReference != tc.byRef {
					t.Errorf("%s: by reference %v, want %v", v.Agent, v.ByReference, tc.byRef)
				}
				if want, ok := tc.against[v.Agent]; ok && v.Against != want {
					t.Errorf("%s: against %q, want %q", v.Agent, v.Against, want)
				}
				if v.Outcome == Disagree && (v.Against == "" || v.Evidence.Outcome != Disagree || v.Reason == "") {
					t.Errorf("%s: conviction without its evidence: %+v", v.Agent, v)
				}
			}
			if g := strings.Join(got, " "); g != tc.want {
				t.Errorf("got %s, want %s", g, tc.want)
			}
		})
	}
}

func TestIndependenceGroups(t *testing.T) {
	a := func(s string) netip.Addr { return netip.MustParseAddr(s) }
	for _, tc := range []struct {
		in    Independence
		agent string
		addr  netip.Addr
		want  string
	}{
		{ByNetwork, "x", a("198.18.7.9"), "198.18.7.0/24"},
		{ByNetwork, "x", a("::ffff:198.18.7.9"), "198.18.7.0/24"},
		{ByNetwork, "x", a("2001:db8:1:2::5"), "2001:db8:1::/48"},
		{ByAddress, "x", a("198.18.7.9"), "198.18.7.9"},
		{ByAgent, "x", a("198.18.7.9"), "agent:x"},
		{ByNetwork, "cloud", netip.Addr{}, "agent:cloud"},
	} {
		if got := tc.in.Group(tc.agent, tc.addr); got != tc.want {
			t.Errorf("%v.Group(%s, %v) = %q, want %q", tc.in, tc.agent, tc.addr, got, tc.want)
		}
	}
	for _, n := range []string{"network", "address", "agent"} {
		if in, err := ParseIndependence(n); err != nil || in.String() != n {
			t.Errorf("ParseIndependence(%q) = %v, %v", n, in, err)
		}
	}
	if _, err := ParseIndependence("ip"); err == nil {
		t.Error("ParseIndependence(ip) took it")
	}
}
