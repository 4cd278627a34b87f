//! The workspace's shape (README's "What depends on what"): no import cycle between the
//! top-level modules of any crate. A newcomer reads a crate from its leaves up; a cycle
//! means two modules can only be understood together, and usually a type in the wrong home.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every crate's `src` directory.
fn crate_sources() -> Vec<PathBuf> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut dirs = vec![
        repo.join("plugin/src"),
        repo.join("runner/src"),
        repo.join("service/src"),
        repo.join("tests/src"),
    ];
    for e in std::fs::read_dir(repo.join("crates")).unwrap().flatten() {
        dirs.push(e.path().join("src"));
    }
    dirs.retain(|d| d.is_dir());
    dirs
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The product code of a file: comments and its unit tests (`#[cfg(test)] mod ...` at the
/// top level, which by convention ends the file) left out.
fn product_code(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if line.starts_with("#[cfg(test)]")
            && lines.peek().is_some_and(|next| next.starts_with("mod "))
        {
            break;
        }
        if !line.trim_start().starts_with("//") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// `crate::NAME` and `use crate::{NAME, ...}` in `code`.
fn crate_references(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for item in group.split(',') {
                found.insert(ident(item.trim()));
            }
        } else {
            found.insert(ident(rest));
        }
    }
    found
}

/// Top-level module → the top-level modules its product code names.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "main" || top == "bin" {
            continue;
        }
        let refs = crate_references(&product_code(&std::fs::read_to_string(f).unwrap()));
        graph.entry(top).or_default().extend(refs);
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for (m, refs) in graph.iter_mut() {
        refs.retain(|r| modules.contains(r) && r != m);
    }
    graph
}

/// A cycle through `start`, if there is one (depth-first search for a path back to it).
fn cycle_through(graph: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    fn walk(
        graph: &BTreeMap<String, BTreeSet<String>>,
        start: &str,
        at: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in graph.get(at).into_iter().flatten() {
            if next == start {
                return true;
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if walk(graph, start, next, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![start.to_string()];
    walk(graph, start, start, &mut path, &mut BTreeSet::new()).then_some(path)
}

#[test]
fn no_crate_has_an_import_cycle_between_its_modules() {
    let mut cycles = Vec::new();
    for src in crate_sources() {
        let graph = module_graph(&src);
        assert!(!graph.is_empty(), "{} has no modules?", src.display());
        for m in graph.keys() {
            if let Some(cycle) = cycle_through(&graph, m) {
                cycles.push(format!("{}: {} -> {m}", src.display(), cycle.join(" -> ")));
                break;
            }
        }
    }
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn the_cycle_finder_finds_a_cycle() {
    let refs = crate_references("use crate::{a, b::c};\nlet x = crate::d::e();");
    assert_eq!(refs, ["a", "b", "d"].map(String::from).into());
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(m, r)| (m.to_string(), r.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(cycle_through(&graph, "a").unwrap(), ["a", "b", "c"]);
    assert!(cycle_through(&graph, "d").is_none());
    assert!(product_code("x\n// crate::y\n#[cfg(test)]\nmod tests { crate::z }\n").trim() == "x");
}

/// What `package` builds against: its normal dependencies, all the way down, as `cargo tree`
/// resolves them for it alone (the names only).
fn normal_dependencies(package: &str) -> BTreeSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new(cargo)
        .current_dir(&repo)
        .args([
            "tree",
            "--locked",
            "--offline",
            "-e",
            "normal",
            "--prefix",
            "none",
            "-p",
        ])
        .arg(package)
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(String::from)
        .collect()
}

/// The service's core names no adapter: what it builds against has no HTTP server or client,
/// no database driver and no command-line parser. A dependency added by mistake, even through
/// a leaf crate's feature, fails here.
#[test]
fn the_service_core_depends_on_no_adapter_crate() {
    let names = normal_dependencies("kernelkite-core");
    assert!(
        names.contains("tokio") && names.contains("kernelkite-kernelbot"),
        "{names:?}"
    );
    let adapters: Vec<&str> = ["axum", "hyper", "sqlx", "reqwest", "clap"]
        .into_iter()
        .filter(|a| names.contains(*a))
        .collect();
    assert!(
        adapters.is_empty(),
        "kernelkite-core depends on {adapters:?}; those belong to kernelkite-service's adapters"
    );
}

/// The leaf crates' testkit depends on no kernelkite crate, so testing a leaf crate builds
/// nothing of the service's.
#[test]
fn the_leaf_testkit_depends_on_no_kernelkite_crate() {
    let names = normal_dependencies("kernelkite-testkit-leaf");
    let ours: Vec<&String> = names
        .iter()
        .filter(|n| n.starts_with("kernelkite-") && *n != "kernelkite-testkit-leaf")
        .collect();
    assert!(
        names.contains("tempfile") && ours.is_empty(),
        "kernelkite-testkit-leaf depends on {ours:?}"
    );
}
