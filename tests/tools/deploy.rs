//! The files in `deploy/` as an operator uses them: the systemd units pass
//! `systemd-analyze verify`, and nginx accepts `deploy/nginx.conf` and, run with it in
//! front of a real server, serves the API, the cached sale pages and local-only metrics.

use crate::common;

use std::path::PathBuf;
use std::process::{Command, Stdio};

fn deploy_file(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_systemd_units_verify() {
    let dir = std::env::temp_dir().join(common::unique("units"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut units = Vec::new();
    for name in ["seckill.service", "seckill-worker.service"] {
        // The unit names /usr/local/bin/seckill; this machine has the test build instead.
        let text =
            deploy_file(name).replace("/usr/local/bin/seckill", env!("CARGO_BIN_EXE_seckill"));
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        units.push(path);
    }
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .args(&units)
        .output()
        .expect("systemd-analyze (Debian's systemd; scripts/test installs it)");
    let err = String::from_utf8_lossy(&out.stderr);
    let about_ours: Vec<&str> = err.lines().filter(|l| l.contains("seckill")).collect();
    assert!(out.status.success() && about_ours.is_empty(), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

struct Nginx(std::process::Child);

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM to the master stops its workers too; a SIGKILL would orphan them.
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        for _ in 0..50 {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_fronts_a_server_with_the_example_configuration() {
    // As in production: dev mode off, /metrics read with its token only.
    let metrics_token = "m".repeat(40);
    let server = common::Server::embedded(&[
        ("SECKILL_DEV", "0"),
        ("SECKILL_METRICS_TOKEN", &metrics_token),
    ])
    .await;
    server.api().open_sale(10, 1).await;
    let upstream = server.base.trim_start_matches("http://").to_string();
    let port = common::free_port();
    let dir = std::env::temp_dir().join(common::unique("nginx"));
    std::fs::create_dir_all(dir.join("cache")).unwrap();
    let site = deploy_file("nginx.conf")
        .replace("server 127.0.0.1:8080;", &format!("server {upstream};"))
        .replace("listen 80;", &format!("listen 127.0.0.1:{port};"))
        .replace(
            "/var/cache/nginx/seckill",
            &dir.join("cache").display().to_string(),
        );
    std::fs::write(dir.join("seckill.conf"), site).unwrap();
    let d = dir.display();
    let main = format!(
        "daemon off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  \
         fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n  \
         include {d}/seckill.conf;\n}}\n"
    );
    std::fs::write(dir.join("main.conf"), main).unwrap();
    let nginx = std::env::var("SECKILL_NGINX").unwrap_or_else(|_| "nginx".into());
    let check = Command::new(&nginx)
        .args(["-t", "-p"])
        .arg(&dir)
        .arg("-c")
        .arg(dir.join("main.conf"))
        .output()
        .expect("nginx (Debian's nginx-light; scripts/test installs it)");
    assert!(
        check.status.success(),
        "nginx -t: {}",
        String::from_utf8_lossy(&check.stderr)
    );
    let _nginx = Nginx(
        Command::new(&nginx)
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(dir.join("main.conf"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // The API through nginx.
    let front = common::Api::new(&format!("http://127.0.0.1:{port}"));
    common::eventually(10, "nginx answers", || async {
        let answer = common::Api::try_send(front.request(reqwest::Method::GET, "/api/sales")).await;
        answer.is_ok_and(|r| (200..300).contains(&r.status))
    })
    .await;
    let sales = front.sales().await.json();
    assert_eq!(sales.as_array().map(Vec::len), Some(1), "{sales}");
    assert_eq!(front.readyz().await.status, 200);
    let r = front.get("/metrics", None).await;
    assert_eq!(r.status, 401, "metrics without the token");
    let r = front.get("/metrics", Some(&metrics_token)).await;
    assert_eq!(r.status, 200, "metrics from this host, with the token");
    // A purchase goes through to the instance (and is answered by it, not by nginx).
    let r = front.post("/api/sales/1/purchase", None, None).await;
    assert_eq!(r.status, 401);
    let body = r.json();
    assert_eq!(body["code"], "unauthorized", "{body}");
    let _ = std::fs::remove_dir_all(&dir);
}
