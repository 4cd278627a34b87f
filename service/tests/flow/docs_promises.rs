//! The README's Guarantees tables name, on every row, the tests that show the promise (issue
//! 21): each row names at least one, and each name is a test that exists, in Rust
//! (`fn name(`) or in the Python suite (`def name(`). A renamed or deleted test fails here
//! instead of leaving a promise without its evidence.

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every `.rs` and `.py` file under `dir`, build output left out.
fn sources(dir: &Path, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if path.is_dir() {
            if !matches!(name.as_str(), "target" | ".git" | "node_modules") {
                sources(&path, out);
            }
        } else if name.ends_with(".rs") || name.ends_with(".py") {
            if let Ok(text) = std::fs::read_to_string(&path) {
                out.push(text);
            }
        }
    }
}

/// The test names in a row's last column: backticked snake_case words.
fn names(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| {
            !w.is_empty()
                && w.contains('_')
                && w.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        })
        .map(str::to_string)
        .collect()
}

#[test]
fn every_promise_in_the_readme_names_tests_that_exist() {
    let readme = std::fs::read_to_string(repo().join("service/README.md")).unwrap();
    let start = readme
        .find("## Guarantees")
        .expect("the Guarantees section");
    let end = start + readme[start..].find("Not promised").expect("its end");
    let mut files = Vec::new();
    for dir in ["service", "tests", "crates", "clients/python/tests"] {
        sources(&repo().join(dir), &mut files);
    }
    let mut rows = 0;
    for line in readme[start..end].lines() {
        let cells: Vec<&str> = line.trim().trim_matches('|').split('|').collect();
        if !line.starts_with("| ") || cells.len() < 4 || line.starts_with("| what") {
            continue;
        }
        rows += 1;
        // The store columns of a table that has them (`| SQLite | PostgreSQL |`), else the
        // last: each names its tests, or starts with "—" and says why it needs none.
        let shown_by = if cells.len() >= 5 {
            &cells[3..]
        } else {
            &cells[cells.len() - 1..]
        };
        let mut tests = Vec::new();
        for cell in shown_by {
            let cell = cell.trim();
            if let Some(why) = cell.strip_prefix('—') {
                assert!(
                    why.trim().len() > 10,
                    "a store cell without a test says why: {line}"
                );
                continue;
            }
            let named = names(cell);
            assert!(!named.is_empty(), "a promise without its test: {line}");
            tests.extend(named);
        }
        for t in tests {
            let (rust, python) = (format!("fn {t}("), format!("def {t}("));
            assert!(
                files
                    .iter()
                    .any(|f| f.contains(&rust) || f.contains(&python)),
                "the README names {t}, which is no test: {line}"
            );
        }
    }
    assert!(
        rows >= 20,
        "only {rows} rows found: has the table changed shape?"
    );
}
