//! Starting a test's real programs (mock-worker, mmrouter-sidecar) on free ports.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Starts a program, reads `listening on ADDR` from its stderr and keeps the other lines.
pub fn spawn_listening(program: &str, args: &[&str]) -> (Child, u16, Arc<Mutex<Vec<String>>>) {
    let mut child = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let stderr = child.stderr.take().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let log2 = log.clone();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some(rest) = line.split("listening on ").nth(1)
                && let Some(t) = tx.take()
            {
                let _ = t.send(rest.split_whitespace().next().unwrap_or("").to_string());
            }
            log2.lock().unwrap().push(line);
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("{program} did not report its address"));
    let port = addr.rsplit(':').next().unwrap().parse().unwrap();
    (child, port, log)
}
