// Renders chat templates the way Ollama does (template.Execute in github.com/ollama/ollama/template), with
// Go's own text/template, so the tests can compare a Modelfile TEMPLATE with the model's Jinja template.
//
// stdin: a JSON list of {"template": "...", "messages": [{"role": "...", "content": "..."}, ...]}
// stdout: a JSON list of {"output": "..."} or {"error": "..."}, one per case.
//
// What is emulated (read from Ollama's template package): the template is parsed with missingkey=zero; when
// it refers to .Messages it is executed once with .System (the system messages' text joined by a blank line),
// .Messages (consecutive messages of one role merged with a blank line, tool messages excepted; system
// messages stay in the list), .Tools nil, .Response "", .Think false. Templates written with .Prompt and
// .Response only (Ollama's legacy path) are reported as errors: the exporter does not write them.
//
// Run: go run tests/gotemplate/render.go < cases.json  (standard library only; no module needed)
package main

import (
	"encoding/json"
	"errors"
	"os"
	"strings"
	"text/template"
	"text/template/parse"
)

type message struct {
	Role       string `json:"role"`
	Content    string `json:"content"`
	Thinking   string
	Images     []string
	ToolCalls  []any
	ToolName   string
	ToolCallID string
}

type tcase struct {
	Template string    `json:"template"`
	Messages []message `json:"messages"`
}

type result struct {
	Output *string `json:"output,omitempty"`
	Error  string  `json:"error,omitempty"`
}

// identifiers collects the field names a template refers to (lower-cased), as Ollama's Vars does.
func identifiers(n parse.Node, out map[string]bool) {
	switch n := n.(type) {
	case *parse.ListNode:
		if n == nil {
			return
		}
		for _, c := range n.Nodes {
			identifiers(c, out)
		}
	case *parse.ActionNode:
		identifiers(n.Pipe, out)
	case *parse.TemplateNode:
		if n.Pipe != nil {
			identifiers(n.Pipe, out)
		}
	case *parse.IfNode:
		identifiers(&n.BranchNode, out)
	case *parse.RangeNode:
		identifiers(&n.BranchNode, out)
	case *parse.WithNode:
		identifiers(&n.BranchNode, out)
	case *parse.BranchNode:
		identifiers(n.Pipe, out)
		identifiers(n.List, out)
		if n.ElseList != nil {
			identifiers(n.ElseList, out)
		}
	case *parse.PipeNode:
		if n == nil {
			return
		}
		for _, c := range n.Cmds {
			for _, a := range c.Args {
				identifiers(a, out)
			}
		}
	case *parse.FieldNode:
		for _, id := range n.Ident {
			out[strings.ToLower(id)] = true
		}
	case *parse.VariableNode:
		for _, id := range n.Ident[1:] {
			out[strings.ToLower(id)] = true
		}
	case *parse.ChainNode:
		identifiers(n.Node, out)
		for _, id := range n.Field {
			out[strings.ToLower(id)] = true
		}
	}
}

func collate(msgs []message) (string, []*message) {
	var system []string
	var out []*message
	for i := range msgs {
		m := msgs[i]
		if m.Role == "system" {
			system = append(system, m.Content)
		}
		if len(out) > 0 && out[len(out)-1].Role == m.Role && m.Role != "tool" {
			out[len(out)-1].Content += "\n\n" + m.Content
		} else {
			out = append(out, &m)
		}
	}
	return strings.Join(system, "\n\n"), out
}

func render(c tcase) (string, error) {
	funcs := template.FuncMap{"json": func(v any) string { b, _ := json.Marshal(v); return string(b) }}
	t, err := template.New("").Option("missingkey=zero").Funcs(funcs).Parse(c.Template)
	if err != nil {
		return "", err
	}
	vars := map[string]bool{}
	for _, tt := range t.Templates() {
		identifiers(tt.Root, vars)
	}
	if !vars["messages"] {
		return "", errors.New("legacy template (.Prompt/.Response without .Messages): not emulated")
	}
	system, msgs := collate(c.Messages)
	var b strings.Builder
	err = t.Execute(&b, map[string]any{
		"System":     system,
		"Messages":   msgs,
		"Tools":      nil,
		"Response":   "",
		"Think":      false,
		"ThinkLevel": "",
		"IsThinkSet": false,
	})
	return b.String(), err
}

func main() {
	var cases []tcase
	if err := json.NewDecoder(os.Stdin).Decode(&cases); err != nil {
		os.Stderr.WriteString("bad input: " + err.Error() + "\n")
		os.Exit(2)
	}
	results := make([]result, len(cases))
	for i, c := range cases {
		out, err := render(c)
		if err != nil {
			results[i].Error = err.Error()
		} else {
			results[i].Output = &out
		}
	}
	if err := json.NewEncoder(os.Stdout).Encode(results); err != nil {
		os.Exit(1)
	}
}
