//! The operators' monitoring, checked against its own tools and against the service: the alert
//! rules (`deployment/prometheus/alerts.yml`) pass `promtool check rules` and their unit tests
//! (`alerts.test.yml`, run by `promtool test rules`), the scrape configuration passes `promtool
//! check config`, every query of the Grafana dashboard (`deployment/grafana/kernelkite.json`)
//! parses as PromQL in promtool, the dashboard is a model Grafana loads, and every metric and
//! label either one names is one the running service serves at `GET /metrics`, so a renamed
//! metric breaks this test rather than a panel or an alert in production.
//!
//! promtool is Debian's `prometheus` package; without it the tests that run it are skipped,
//! counted as skipped. The checks of the files' structure and of the metrics' names need only
//! the service.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use kernelkite_service::metrics::{
    CallLabel, Metrics, OpLabel, OutcomeLabel, QueueLabel, QuotaLabel, ReasonLabel, Refusal,
    RefusalLabel, SliceLabel, StateLabel, WaitLabel,
};
use kernelkite_testkit::harness::harness;
use kernelkite_testkit::skip;
use serde_json::{json, Value};
use yaml_rust2::{Yaml, YamlLoader};

const ALERTS: &str = "deployment/prometheus/alerts.yml";
const ALERT_TESTS: &str = "deployment/prometheus/alerts.test.yml";
const PROMETHEUS: &str = "deployment/prometheus/prometheus.yml";
const DASHBOARD: &str = "deployment/grafana/kernelkite.json";
const GRAFANA_DATASOURCES: &str = "deployment/grafana/provisioning/datasources.yml";
const GRAFANA_DASHBOARDS: &str = "deployment/grafana/provisioning/dashboards.yml";

/// Labels every scraped series carries besides its own: Prometheus adds them.
const SCRAPE_LABELS: [&str; 2] = ["job", "instance"];

const NO_PROMTOOL: &str =
    "promtool is not installed (Debian's prometheus package: apt-get install prometheus)";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn yaml(rel: &str) -> Yaml {
    let mut docs = YamlLoader::load_from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
    assert_eq!(docs.len(), 1, "{rel}: one YAML document");
    docs.remove(0)
}

fn dashboard() -> Value {
    serde_json::from_str(&read(DASHBOARD)).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"))
}

/// `promtool` on PATH, if it runs.
fn promtool() -> Option<&'static str> {
    Command::new("promtool")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| "promtool")
}

/// Runs `promtool ARGS`: whether it succeeded, and what it printed.
fn run_promtool(bin: &str, args: &[&std::ffi::OsStr]) -> (bool, String) {
    let out = Command::new(bin).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn promtool_ok(bin: &str, args: &[&std::ffi::OsStr]) {
    let (ok, text) = run_promtool(bin, args);
    assert!(ok, "promtool {args:?} failed:\n{text}");
}

// ---------------------------------------------------------------------------------------------
// a. The alert rules and the scrape configuration, through promtool.

#[test]
fn alert_rules_pass_promtool_check() {
    let Some(bin) = promtool() else {
        skip(NO_PROMTOOL);
        return;
    };
    let path = repo().join(ALERTS);
    promtool_ok(bin, &["check".as_ref(), "rules".as_ref(), path.as_ref()]);
}

#[test]
fn alert_rules_pass_their_unit_tests() {
    let Some(bin) = promtool() else {
        skip(NO_PROMTOOL);
        return;
    };
    // promtool reads rule_files relative to the test file.
    let path = repo().join(ALERT_TESTS);
    promtool_ok(bin, &["test".as_ref(), "rules".as_ref(), path.as_ref()]);
}

#[test]
fn scrape_config_passes_promtool_check() {
    let Some(bin) = promtool() else {
        skip(NO_PROMTOOL);
        return;
    };
    // Checks the rule files it names too (alerts.yml, beside it).
    let path = repo().join(PROMETHEUS);
    promtool_ok(bin, &["check".as_ref(), "config".as_ref(), path.as_ref()]);
    let config = yaml(PROMETHEUS);
    let jobs = config["scrape_configs"].as_vec().expect("scrape_configs");
    assert!(
        jobs.iter()
            .any(|j| j["job_name"].as_str() == Some("kernelkite")
                && j["metrics_path"].as_str() == Some("/metrics")),
        "the alerts name the scrape job `kernelkite`, scraping /metrics"
    );
}

/// `promtool test rules` fails when an alert does not fire as a test expects: the unit tests
/// above can fail.
#[test]
fn promtool_unit_tests_would_catch_an_alert_that_does_not_fire() {
    let Some(bin) = promtool() else {
        skip(NO_PROMTOOL);
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(repo().join(ALERTS), dir.path().join("alerts.yml")).unwrap();
    // An instance that answers every scrape, expected to be reported down.
    let wrong = r#"rule_files: [alerts.yml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'up{job="kernelkite", instance="a:8080"}'
        values: '1x10'
    alert_rule_test:
      - eval_time: 10m
        alertname: KernelkiteDown
        exp_alerts:
          - exp_labels: {severity: critical, job: kernelkite, instance: "a:8080"}
"#;
    let test = dir.path().join("wrong.test.yml");
    std::fs::write(&test, wrong).unwrap();
    let (ok, text) = run_promtool(bin, &["test".as_ref(), "rules".as_ref(), test.as_ref()]);
    assert!(!ok, "a wrong expectation passed:\n{text}");
    assert!(text.contains("KernelkiteDown"), "{text}");
}

/// What operators rely on in every rule, and that the unit tests cover each alert both ways:
/// fired on broken series and silent on healthy ones.
#[test]
fn every_alert_is_actionable_and_tested_firing_and_silent() {
    let alerts = alert_rules();
    assert!(!alerts.is_empty());
    for a in &alerts {
        let name = a["alert"].as_str().unwrap();
        assert!(a["for"].as_str().is_some(), "{name}: no `for:`");
        let severity = a["labels"]["severity"].as_str();
        assert!(
            matches!(severity, Some("critical" | "warning")),
            "{name}: severity {severity:?}"
        );
        for key in ["summary", "description"] {
            let text = a["annotations"][key].as_str().unwrap_or("");
            assert!(!text.trim().is_empty(), "{name}: no {key} annotation");
        }
    }
    let tests = yaml(ALERT_TESTS);
    let mut fired = BTreeSet::new();
    let mut silent = BTreeSet::new();
    for group in tests["tests"].as_vec().expect("tests") {
        for case in group["alert_rule_test"].as_vec().expect("alert_rule_test") {
            let name = case["alertname"].as_str().unwrap().to_string();
            match case["exp_alerts"].as_vec() {
                Some(v) if !v.is_empty() => fired.insert(name),
                _ => silent.insert(name),
            };
        }
    }
    // The healthy service's group checks every alert stays silent on it.
    let healthy: BTreeSet<String> = tests["tests"]
        .as_vec()
        .unwrap()
        .iter()
        .filter(|g| g["name"].as_str() == Some("healthy"))
        .flat_map(|g| g["alert_rule_test"].as_vec().cloned().unwrap_or_default())
        .filter(|c| c["exp_alerts"].as_vec().is_some_and(|v| v.is_empty()))
        .filter_map(|c| c["alertname"].as_str().map(str::to_string))
        .collect();
    for a in &alerts {
        let name = a["alert"].as_str().unwrap();
        assert!(
            fired.contains(name),
            "{ALERT_TESTS}: nothing makes {name} fire"
        );
        assert!(
            silent.contains(name),
            "{ALERT_TESTS}: nothing checks {name} stays silent"
        );
        assert!(
            healthy.contains(name),
            "{ALERT_TESTS}: the healthy group does not check {name} stays silent"
        );
    }
}

/// Every rule of alerts.yml.
fn alert_rules() -> Vec<Yaml> {
    let doc = yaml(ALERTS);
    let mut out = Vec::new();
    for group in doc["groups"].as_vec().expect("groups") {
        out.extend(group["rules"].as_vec().expect("rules").iter().cloned());
    }
    out
}

// ---------------------------------------------------------------------------------------------
// b. Every query of the dashboard is PromQL promtool parses.

/// Grafana's own variables in a query, replaced by what promtool can parse. The data source
/// variable is in the panels' `datasource`, never in a query.
fn without_grafana_variables(expr: &str) -> String {
    let mut out = expr.to_string();
    for (var, value) in [
        ("${__rate_interval}", "5m"),
        ("$__rate_interval", "5m"),
        ("${__interval}", "1m"),
        ("$__interval", "1m"),
        ("${__range}", "6h"),
        ("$__range", "6h"),
    ] {
        out = out.replace(var, value);
    }
    out
}

#[test]
fn dashboard_queries_pass_promtool() {
    let Some(bin) = promtool() else {
        skip(NO_PROMTOOL);
        return;
    };
    let targets = dashboard_targets(&dashboard());
    assert!(!targets.is_empty());
    // One recording rule per query: promtool parses each expression and names the one it
    // cannot. JSON is YAML, so no quoting of the queries is needed.
    let rules: Vec<Value> = targets
        .iter()
        .map(|(panel, ref_id, expr)| {
            let expr = without_grafana_variables(expr);
            assert!(
                !expr.contains('$'),
                "panel {panel} target {ref_id} uses a variable this check cannot replace (only Grafana's $__ intervals are): {expr}"
            );
            json!({"record": format!("dashboard:panel_{panel}_{ref_id}"), "expr": expr})
        })
        .collect();
    let doc = json!({"groups": [{"name": "dashboard", "rules": rules}]});
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dashboard-queries.yml");
    std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    promtool_ok(bin, &["check".as_ref(), "rules".as_ref(), path.as_ref()]);
    // promtool does refuse a query that does not parse (the check above can fail).
    let bad = json!({"groups": [{"name": "bad", "rules": [
        {"record": "dashboard:bad", "expr": "sum by (queue (rate(kernelkite_cache_hits_total[5m]))"}
    ]}]});
    std::fs::write(&path, bad.to_string()).unwrap();
    let (ok, text) = run_promtool(bin, &["check".as_ref(), "rules".as_ref(), path.as_ref()]);
    assert!(!ok, "an unbalanced query passed:\n{text}");
}

/// Every panel, rows' nested panels included.
fn all_panels(dash: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        out.push(p);
        if let Some(nested) = p["panels"].as_array() {
            out.extend(nested);
        }
    }
    out
}

/// (panel id, refId, expr) of every query target.
fn dashboard_targets(dash: &Value) -> Vec<(i64, String, String)> {
    let mut out = Vec::new();
    for p in all_panels(dash) {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push((
                p["id"].as_i64().unwrap_or(-1),
                t["refId"].as_str().unwrap_or("?").to_string(),
                t["expr"].as_str().unwrap_or("").to_string(),
            ));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// c. The dashboard's structure, and the provisioning that loads it.

/// What is wrong with a dashboard model, each as a line (none: Grafana loads it as drawn).
fn dashboard_problems(dash: &Value) -> Vec<String> {
    let mut bad = Vec::new();
    if dash["schemaVersion"].as_i64() != Some(39) {
        bad.push(format!(
            "schemaVersion {} (39 wanted)",
            dash["schemaVersion"]
        ));
    }
    for key in ["title", "uid"] {
        if dash[key].as_str().is_none_or(|s| s.trim().is_empty()) {
            bad.push(format!("no {key}"));
        }
    }
    // Grafana refuses longer uids.
    if dash["uid"].as_str().is_some_and(|u| u.len() > 40) {
        bad.push("uid longer than 40 characters".into());
    }
    let vars = dash["templating"]["list"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let has_datasource_var = vars.iter().any(|v| {
        v["name"] == "datasource" && v["type"] == "datasource" && v["query"] == "prometheus"
    });
    if !has_datasource_var {
        bad.push("no `datasource` template variable of Prometheus data sources".into());
    }
    let wanted_ds = json!({"type": "prometheus", "uid": "${datasource}"});
    let mut ids = BTreeSet::new();
    let mut boxes: Vec<(i64, [i64; 4])> = Vec::new();
    for p in all_panels(dash) {
        let Some(id) = p["id"].as_i64() else {
            bad.push(format!("a panel without an id: {}", p["title"]));
            continue;
        };
        if !ids.insert(id) {
            bad.push(format!("panel id {id} used twice"));
        }
        let kind = p["type"].as_str().unwrap_or("");
        if !matches!(kind, "row" | "timeseries" | "stat") {
            bad.push(format!("panel {id}: type {kind:?}"));
        }
        if p["title"].as_str().is_none_or(|t| t.trim().is_empty()) {
            bad.push(format!("panel {id}: no title"));
        }
        let g = &p["gridPos"];
        let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| g[k].as_i64().unwrap_or(-1));
        if x < 0 || y < 0 || w < 1 || h < 1 || w > 24 || x + w > 24 {
            bad.push(format!(
                "panel {id}: gridPos {g} (x + w must fit 24 columns)"
            ));
        } else {
            for (other, [ox, oy, ow, oh]) in &boxes {
                if x < ox + ow && *ox < x + w && y < oy + oh && *oy < y + h {
                    bad.push(format!("panels {other} and {id} overlap"));
                }
            }
            boxes.push((id, [x, y, w, h]));
        }
        if kind == "row" {
            continue;
        }
        if p["datasource"] != wanted_ds {
            bad.push(format!("panel {id}: datasource {}", p["datasource"]));
        }
        let targets = p["targets"].as_array().cloned().unwrap_or_default();
        if targets.is_empty() {
            bad.push(format!("panel {id}: no targets"));
        }
        let mut refs = BTreeSet::new();
        for t in &targets {
            let ref_id = t["refId"].as_str().unwrap_or("");
            if ref_id.is_empty() || !refs.insert(ref_id.to_string()) {
                bad.push(format!(
                    "panel {id}: refId {:?} missing or repeated",
                    t["refId"]
                ));
            }
            if t["datasource"] != wanted_ds {
                bad.push(format!(
                    "panel {id} {ref_id}: datasource {}",
                    t["datasource"]
                ));
            }
            if t["expr"].as_str().is_none_or(|e| e.trim().is_empty()) {
                bad.push(format!("panel {id} {ref_id}: no expr"));
            }
        }
    }
    bad
}

#[test]
fn dashboard_is_a_model_grafana_loads() {
    let dash = dashboard();
    let problems = dashboard_problems(&dash);
    assert!(problems.is_empty(), "{DASHBOARD}:\n{}", problems.join("\n"));
    // The operators' rows, in order.
    let rows: Vec<&str> = all_panels(&dash)
        .into_iter()
        .filter(|p| p["type"] == "row")
        .filter_map(|p| p["title"].as_str())
        .collect();
    assert_eq!(
        rows,
        [
            "Queues",
            "Buildkite",
            "Webhooks and callbacks",
            "Store",
            "HTTP edge",
            "Fleet"
        ]
    );
}

/// One way of breaking a dashboard model.
type Fault = fn(&mut Value);

/// The structural check can fail: each kind of fault it looks for is found.
#[test]
fn the_dashboard_check_would_catch_a_broken_model() {
    let good = dashboard();
    let faults: [(&str, Fault); 8] = [
        ("used twice", |d| {
            d["panels"][2]["id"] = d["panels"][1]["id"].clone()
        }),
        ("fit 24 columns", |d| {
            d["panels"][1]["gridPos"]["x"] = json!(22)
        }),
        ("overlap", |d| {
            d["panels"][2]["gridPos"] = d["panels"][1]["gridPos"].clone()
        }),
        ("missing or repeated", |d| {
            d["panels"][1]["targets"][0]["refId"] = json!("")
        }),
        ("datasource", |d| {
            d["panels"][1]["targets"][0]["datasource"] = json!({"uid": "prom"})
        }),
        ("schemaVersion", |d| d["schemaVersion"] = Value::Null),
        ("no uid", |d| d["uid"] = json!("")),
        ("template variable", |d| d["templating"]["list"] = json!([])),
    ];
    for (want, fault) in faults {
        let mut d = good.clone();
        fault(&mut d);
        let problems = dashboard_problems(&d);
        assert!(
            problems.iter().any(|p| p.contains(want)),
            "a fault ({want}) went unnoticed: {problems:?}"
        );
    }
}

#[test]
fn grafana_provisioning_loads_the_dashboard() {
    let ds = yaml(GRAFANA_DATASOURCES);
    assert_eq!(ds["apiVersion"].as_i64(), Some(1));
    let sources = ds["datasources"].as_vec().expect("datasources");
    assert!(
        sources
            .iter()
            .any(|s| s["type"].as_str() == Some("prometheus") && s["url"].as_str().is_some()),
        "{GRAFANA_DATASOURCES}: no Prometheus data source"
    );
    let dashboards = yaml(GRAFANA_DASHBOARDS);
    assert_eq!(dashboards["apiVersion"].as_i64(), Some(1));
    let providers = dashboards["providers"].as_vec().expect("providers");
    let path = providers
        .iter()
        .find(|p| p["type"].as_str() == Some("file"))
        .and_then(|p| p["options"]["path"].as_str())
        .expect("a file provider with options.path");
    // The deployment README mounts the dashboard where the provider reads.
    let readme = read("deployment/README.md");
    assert!(
        readme.contains(path),
        "deployment/README.md does not put kernelkite.json in {path}"
    );
}

// ---------------------------------------------------------------------------------------------
// d. Every metric and label named is one the service serves.

/// The kind of a scraped sample name, as `rate()` needs to know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Only goes up: a counter, or a histogram's `_bucket`, `_sum`, `_count`.
    Cumulative,
    /// Goes up and down.
    Gauge,
}

/// What `/metrics` serves, as Prometheus stores it after a scrape.
#[derive(Debug, Default)]
struct Exposed {
    /// Each sample name, its kind, and the label names seen on it (None: no sample of its
    /// family was served, so its labels are unknown).
    names: BTreeMap<String, (Kind, Option<BTreeSet<String>>)>,
}

impl Exposed {
    /// Reads OpenMetrics text: the names from each family's `# TYPE` line (served whether or
    /// not the family has a sample), the labels from its samples.
    fn parse(text: &str) -> Exposed {
        let mut families: Vec<(String, String)> = Vec::new();
        let mut e = Exposed::default();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
                let names: Vec<(String, Kind)> = match kind {
                    "counter" => vec![(format!("{name}_total"), Kind::Cumulative)],
                    "histogram" => ["_bucket", "_sum", "_count"]
                        .iter()
                        .map(|s| (format!("{name}{s}"), Kind::Cumulative))
                        .collect(),
                    _ => vec![(name.to_string(), Kind::Gauge)],
                };
                for (n, k) in names {
                    e.names.insert(n, (k, None));
                }
                families.push((name.to_string(), kind.to_string()));
                continue;
            }
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            let name = &line[..end];
            let labels: BTreeSet<String> = match line[end..].strip_prefix('{') {
                Some(rest) => label_names(rest),
                None => BTreeSet::new(),
            };
            let entry = e.names.entry(name.to_string()).or_insert_with(|| {
                // A sample of no `# TYPE` line (e.g. `_created`): counted as cumulative only if
                // its family says so.
                let counter = families
                    .iter()
                    .any(|(f, k)| name.starts_with(f.as_str()) && k != "gauge");
                let kind = if counter {
                    Kind::Cumulative
                } else {
                    Kind::Gauge
                };
                (kind, None)
            });
            entry.1.get_or_insert_with(BTreeSet::new).extend(labels);
        }
        e
    }
}

/// The label names of `a="x",b="y\"z"}...`, up to the closing brace.
fn label_names(s: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| *c == ',' || c.is_whitespace()).is_some() {}
        let name: String =
            std::iter::from_fn(|| chars.next_if(|c| *c != '=' && *c != '}')).collect();
        if chars.next() != Some('=') {
            break;
        }
        out.insert(name.trim().to_string());
        if chars.next() != Some('"') {
            break;
        }
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => break,
                _ => {}
            }
        }
    }
    out
}

/// A PromQL token.
#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    /// A range or subquery (`[5m]`, `[1h:1m]`): what is inside is no name.
    Range,
    Number,
    Punct(char),
}

fn tokens(expr: &str) -> Vec<Tok> {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '#' {
            // A comment, to the end of the line.
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '"' || c == '\'' || c == '`' {
            let mut s = String::new();
            i += 1;
            while i < chars.len() && chars[i] != c {
                if chars[i] == '\\' && c != '`' {
                    i += 1;
                }
                if let Some(&ch) = chars.get(i) {
                    s.push(ch);
                }
                i += 1;
            }
            i += 1;
            out.push(Tok::Str(s));
        } else if c == '[' {
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
            out.push(Tok::Range);
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || matches!(chars[i], '_' | ':'))
            {
                i += 1;
            }
            out.push(Tok::Ident(chars[start..i].iter().collect()));
        } else if c.is_ascii_digit() || c == '.' {
            // Numbers and durations (`offset 5m`): 1, 0.9, 1e-3, 0x1f, 5m.
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric()
                    || chars[i] == '.'
                    || (matches!(chars[i], '+' | '-') && matches!(chars[i - 1], 'e' | 'E')))
            {
                i += 1;
            }
            out.push(Tok::Number);
        } else {
            out.push(Tok::Punct(c));
            i += 1;
        }
    }
    out
}

/// A series selector in a query: the metric, its matchers' label names, and whether it is
/// the argument of a function over counters.
#[derive(Debug, PartialEq)]
struct Selector {
    name: String,
    labels: Vec<String>,
    in_counter_function: bool,
}

/// The selectors of `expr` and the label names of its `by`/`without`/`on`/`ignoring`/`group_*`
/// lists. Functions and aggregations are told from metrics by what follows them (`(`, or
/// `by`/`without`), so no list of PromQL's functions is needed.
fn selectors(expr: &str) -> (Vec<Selector>, Vec<String>) {
    const GROUPING: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    const KEYWORDS: [&str; 8] = [
        "and", "or", "unless", "bool", "offset", "atan2", "inf", "nan",
    ];
    const COUNTER_FUNCTIONS: [&str; 4] = ["rate", "irate", "increase", "resets"];
    let toks = tokens(expr);
    let mut sels = Vec::new();
    let mut grouping = Vec::new();
    let mut counter_arg = false;
    let mut i = 0;
    while i < toks.len() {
        let next = toks.get(i + 1);
        match &toks[i] {
            Tok::Ident(word)
                if GROUPING.contains(&word.as_str()) && next == Some(&Tok::Punct('(')) =>
            {
                i += 2;
                while let Some(t) = toks.get(i) {
                    match t {
                        Tok::Ident(l) => grouping.push(l.clone()),
                        Tok::Punct(')') => break,
                        _ => {}
                    }
                    i += 1;
                }
            }
            // `group_left` and `group_right` may stand without a list.
            Tok::Ident(word) if GROUPING.contains(&word.as_str()) => {}
            Tok::Ident(word) if KEYWORDS.contains(&word.to_ascii_lowercase().as_str()) => {}
            Tok::Ident(word)
                if next == Some(&Tok::Punct('('))
                    || matches!(next, Some(Tok::Ident(n)) if n == "by" || n == "without") =>
            {
                counter_arg = COUNTER_FUNCTIONS.contains(&word.as_str());
            }
            Tok::Ident(word) => {
                let mut labels = Vec::new();
                if next == Some(&Tok::Punct('{')) {
                    i += 2;
                    while let Some(t) = toks.get(i) {
                        match t {
                            Tok::Punct('}') => break,
                            // A label name is the identifier before `=`, `!=`, `=~`, `!~`.
                            Tok::Ident(l)
                                if matches!(toks.get(i + 1), Some(Tok::Punct('=' | '!'))) =>
                            {
                                labels.push(l.clone())
                            }
                            _ => {}
                        }
                        i += 1;
                    }
                }
                sels.push(Selector {
                    name: word.clone(),
                    labels,
                    in_counter_function: std::mem::take(&mut counter_arg),
                });
            }
            _ => {}
        }
        i += 1;
    }
    (sels, grouping)
}

/// What in `expr` the service does not serve: unknown metrics, labels a metric does not
/// carry, `rate()` over a gauge. `up` is Prometheus's own.
fn unserved(expr: &str, exposed: &Exposed) -> Vec<String> {
    let (sels, grouping) = selectors(expr);
    let mut bad = Vec::new();
    let mut known_labels: BTreeSet<String> = SCRAPE_LABELS.iter().map(|s| s.to_string()).collect();
    for s in &sels {
        if s.name == "up" {
            continue;
        }
        let Some((kind, labels)) = exposed.names.get(&s.name) else {
            bad.push(format!("`{}` is not a metric the service serves", s.name));
            continue;
        };
        if s.in_counter_function && *kind == Kind::Gauge {
            bad.push(format!("`{}` is a gauge, under rate()/increase()", s.name));
        }
        let Some(labels) = labels else {
            if !s.labels.is_empty() {
                bad.push(format!(
                    "`{}` has no sample to read its labels from (give its family a series in `populate`)",
                    s.name
                ));
            }
            continue;
        };
        known_labels.extend(labels.iter().cloned());
        for l in &s.labels {
            if !labels.contains(l) && !SCRAPE_LABELS.contains(&l.as_str()) {
                bad.push(format!(
                    "`{}` has no label `{l}` (it has {labels:?})",
                    s.name
                ));
            }
        }
    }
    for l in grouping {
        if !known_labels.contains(&l) {
            bad.push(format!("no metric of the query has the label `{l}`"));
        }
    }
    bad
}

/// Gives every labelled family of the service's metrics one series, so each family's label
/// names are served. The values are placeholders; the label names are the structs' own.
fn populate(m: &Metrics) {
    let s = || "x".to_string();
    let _ = m.submissions.get_or_create(&StateLabel { state: s() });
    let _ = m
        .webhook_rejections
        .get_or_create(&ReasonLabel { reason: s() });
    let _ = m.buildkite_calls.get_or_create(&CallLabel { call: s() });
    let _ = m
        .buildkite_rate_limited
        .get_or_create(&CallLabel { call: s() });
    let _ = m.callbacks.get_or_create(&OutcomeLabel { outcome: s() });
    let _ = m.store_seconds.get_or_create(&OpLabel { op: s() });
    let _ = m.http_refusals.get_or_create(&RefusalLabel {
        reason: Refusal::ConnectionCap,
    });
    let _ = m.queue_wait_seconds.get_or_create(&WaitLabel {
        queue: s(),
        class: s(),
        user_bucket: s(),
    });
    let _ = m.quota_refusals.get_or_create(&QuotaLabel {
        queue: s(),
        limit: s(),
    });
    let _ = m.cache_hits.get_or_create(&QueueLabel { queue: s() });
    // The fleet's: the upkeep sets them from the fleet, empty in the harness.
    let _ = m.fleet_slices.get_or_create(&StateLabel { state: s() });
    let slice = SliceLabel {
        slice: s(),
        node: s(),
        queue: s(),
    };
    let _ = m.slice_quarantined.get_or_create(&slice);
    let _ = m.slice_gpu_temperature.get_or_create(&slice);
    let _ = m.slice_canary_permille.get_or_create(&slice);
    let _ = m.alerts.get_or_create(&OutcomeLabel { outcome: s() });
}

/// The sample names that carry labels once [`populate`] has run: each labelled family's.
fn populated_names() -> BTreeSet<String> {
    let m = Metrics::new();
    populate(&m);
    Exposed::parse(&m.render())
        .names
        .into_iter()
        .filter(|(_, (_, labels))| labels.as_ref().is_some_and(|l| !l.is_empty()))
        .map(|(name, _)| name)
        .collect()
}

/// Every PromQL expression operators run: the dashboard's queries, the alerts' expressions,
/// and the series the alerts' unit tests feed them (a series is a selector too), each named.
fn every_query() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (panel, ref_id, expr) in dashboard_targets(&dashboard()) {
        out.push((
            format!("{DASHBOARD} panel {panel} {ref_id}"),
            without_grafana_variables(&expr),
        ));
    }
    for rule in alert_rules() {
        let name = rule["alert"]
            .as_str()
            .or(rule["record"].as_str())
            .unwrap_or("?");
        out.push((
            format!("{ALERTS} {name}"),
            rule["expr"].as_str().unwrap().to_string(),
        ));
    }
    let tests = yaml(ALERT_TESTS);
    for group in tests["tests"].as_vec().expect("tests") {
        for series in group["input_series"].as_vec().into_iter().flatten() {
            let s = series["series"].as_str().unwrap().to_string();
            out.push((
                format!("{ALERT_TESTS} {}", group["name"].as_str().unwrap_or("?")),
                s,
            ));
        }
    }
    out
}

#[tokio::test]
async fn every_metric_named_is_one_the_service_serves() {
    let h = harness().await;
    // The fleet's upkeep clears its families and sets them again every 2 s, which can drop
    // what `populate` gave them before the scrape: scrape until every labelled family is
    // served with its labels.
    let wanted = populated_names();
    assert!(
        wanted.contains("kernelkite_slice_quarantined"),
        "{wanted:?}"
    );
    let mut tries = 0;
    let (text, exposed) = loop {
        populate(h.app.metrics());
        let text = h
            .http
            .get(format!("{}/metrics", h.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let exposed = Exposed::parse(&text);
        assert!(
            exposed.names.contains_key("kernelkite_submissions"),
            "the service's /metrics did not parse:\n{text}"
        );
        let missing: Vec<&String> = wanted
            .iter()
            .filter(|n| !matches!(exposed.names.get(*n), Some((_, Some(_)))))
            .collect();
        if missing.is_empty() {
            break (text, exposed);
        }
        tries += 1;
        assert!(
            tries < 20,
            "the service's /metrics serves no sample of {missing:?}:\n{text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let queries = every_query();
    let mut used = BTreeSet::new();
    let mut problems = Vec::new();
    for (place, expr) in &queries {
        used.extend(selectors(expr).0.into_iter().map(|s| s.name));
        for p in unserved(expr, &exposed) {
            problems.push(format!("{place}: {p}\n    {expr}"));
        }
    }
    assert!(
        problems.is_empty(),
        "not served by the service's /metrics:\n{}\n\nit serves:\n{text}",
        problems.join("\n")
    );
    // The scan found the names (an empty scan would pass anything).
    assert!(used.len() > 10, "{used:?}");
}

/// The check of names can fail: a misspelt metric, a label a metric lacks, a gauge under
/// rate(), a grouping by a label no metric has, each on a service's real families.
#[test]
fn the_metric_check_would_catch_a_name_the_service_does_not_serve() {
    let m = Metrics::new();
    populate(&m);
    let exposed = Exposed::parse(&m.render());
    let good = "sum by (job, outcome) (rate(kernelkite_callbacks_total{outcome=~\"given_up|refused\"}[5m])) / on (job) group_left sum by (job) (rate(kernelkite_callbacks_total[5m])) > 0.1 and up{job=\"kernelkite\"} == 1";
    assert_eq!(unserved(good, &exposed), Vec::<String>::new());
    let hist =
        "histogram_quantile(0.99, sum by (op, le) (rate(kernelkite_store_seconds_bucket[5m])))";
    assert_eq!(unserved(hist, &exposed), Vec::<String>::new());
    for (bad, want) in [
        (
            "rate(kernelkite_callback_total[5m])",
            "kernelkite_callback_total",
        ),
        ("sum(kernelkite_callbacks)", "kernelkite_callbacks"),
        (
            "kernelkite_callbacks_total{outcom=\"x\"}",
            "no label `outcom`",
        ),
        ("rate(kernelkite_submissions[5m])", "is a gauge"),
        ("sum by (queue) (kernelkite_submissions)", "label `queue`"),
        (
            "kernelkite_store_seconds{op=\"insert\"}",
            "kernelkite_store_seconds`",
        ),
        (
            "rate(kernelkite_slice_gpu_temperature_celsius[5m])",
            "is a gauge",
        ),
        ("max by (slice) (kernelkite_fleet_slices)", "label `slice`"),
        (
            "kernelkite_slice_quarantined{state=\"x\"}",
            "no label `state`",
        ),
        ("increase(kernelkite_alerts[15m])", "kernelkite_alerts`"),
    ] {
        let found = unserved(bad, &exposed);
        assert!(
            found.iter().any(|p| p.contains(want)),
            "{bad}: expected a problem naming {want}, got {found:?}"
        );
    }
}

#[test]
fn the_query_scan_tells_metrics_from_functions_and_labels() {
    let (sels, grouping) = selectors(
        "histogram_quantile(0.9, sum by (queue, le) (rate(a_bucket{x=\"1\", y!~'2'}[5m] offset 1h))) > 1e-3 unless on (job) group_left max without (z) (b) and sum(c) by (w)",
    );
    let names: Vec<&str> = sels.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["a_bucket", "b", "c"]);
    assert_eq!(sels[0].labels, ["x", "y"]);
    assert!(sels[0].in_counter_function);
    assert!(!sels[1].in_counter_function);
    assert_eq!(grouping, ["queue", "le", "job", "z", "w"]);
}
