//! The web pages in a real browser: headless Chromium (Debian's `chromium` and
//! `chromium-driver`; `scripts/test` installs them) driven over WebDriver by fantoccini,
//! against a real server. A buyer waits for the opening, buys, pays on the simulated
//! provider's page and sees the order paid; a second buyer sees sold out; the admin
//! creates, approves, pauses and watches a sale while purchases arrive.
//!
//! A failing test saves a screenshot of the page as it was under
//! `target/browser-screenshots/` (named after the test); passing runs save one of each
//! page there too (the documents' pictures come from them).

use crate::common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{free_port, Api, Server};
use fantoccini::{Client, ClientBuilder, Locator};
use reqwest::Method;
use serde_json::{json, Value};

fn screenshots() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/browser-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn chromedriver() -> Option<PathBuf> {
    let path = std::env::var_os("SECKILL_CHROMEDRIVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromedriver"));
    path.exists().then_some(path)
}

/// One headless Chromium with its own driver, profile and window size.
struct Browser {
    driver: Child,
    client: Client,
    _profile: tempfile_dir::Dir,
    /// One browser at a time: two Chromiums beside the rest of the suite on two cores made
    /// the pages' timings (an opening seconds away) miss in CI.
    _turn: tokio::sync::OwnedMutexGuard<()>,
}

/// The browser tests' turn (see `Browser::_turn`).
fn browser_turn() -> std::sync::Arc<tokio::sync::Mutex<()>> {
    static TURN: std::sync::OnceLock<std::sync::Arc<tokio::sync::Mutex<()>>> =
        std::sync::OnceLock::new();
    TURN.get_or_init(Default::default).clone()
}

mod tempfile_dir {
    /// A folder removed when dropped.
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Browser {
    /// None when no chromedriver is installed and the run does not require one.
    async fn start(width: u32, height: u32) -> Option<Browser> {
        Browser::launch(width, height, false).await
    }

    /// A phone: the page laid out for a 390 x 844 touch screen (headless windows cannot
    /// be narrower than 500 px, so the width is emulated).
    async fn phone() -> Option<Browser> {
        Browser::launch(390, 844, true).await
    }

    async fn launch(width: u32, height: u32, phone: bool) -> Option<Browser> {
        let turn = browser_turn().lock_owned().await;
        let Some(driver_path) = chromedriver() else {
            assert!(
                std::env::var_os("SECKILL_BROWSER_REQUIRED").is_none(),
                "chromedriver is missing (apt-get install chromium chromium-driver)"
            );
            eprintln!("browser tests skipped: no chromedriver (scripts/test installs it)");
            return None;
        };
        let port = free_port();
        let driver = Command::new(driver_path)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let profile = tempfile_dir::Dir(std::env::temp_dir().join(common::unique("chromium")));
        let mut options = json!({
                "binary": std::env::var("SECKILL_CHROMIUM").unwrap_or("/usr/bin/chromium".into()),
                // Chromium's own network chatter is refused on a closed network, and as
                // root it needs --no-sandbox.
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-quic", "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    format!("--window-size={width},{height}"),
                    format!("--user-data-dir={}", profile.0.display()),
                ],
        });
        if phone {
            options["mobileEmulation"] = json!({
                "deviceMetrics": { "width": width, "height": height, "pixelRatio": 2.0, "touch": true },
            });
        }
        let mut caps = serde_json::Map::new();
        caps.insert("goog:chromeOptions".into(), options);
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        let client = loop {
            match ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
                .capabilities(caps.clone())
                .connect(&url)
                .await
            {
                Ok(c) => break c,
                Err(e) if Instant::now() > deadline => panic!("no WebDriver session: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        Some(Browser {
            driver,
            client,
            _profile: profile,
            _turn: turn,
        })
    }

    /// Runs `steps`; if they fail, saves the page as `{name}-failure.png` and fails.
    async fn run<F, Fut>(self, name: &str, steps: F)
    where
        F: FnOnce(Client) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let outcome = tokio::spawn(steps(self.client.clone())).await;
        if let Err(failure) = outcome {
            let path = screenshots().join(format!("{name}-failure.png"));
            if let Ok(png) = self.client.screenshot().await {
                let _ = std::fs::write(&path, png);
                eprintln!("screenshot of the failing page: {}", path.display());
            }
            self.close().await;
            std::panic::resume_unwind(failure.into_panic());
        }
        self.close().await;
    }

    async fn close(mut self) {
        let _ = self.client.clone().close().await;
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

async fn shot(c: &Client, name: &str) {
    let png = c.screenshot().await.expect("screenshot");
    std::fs::write(screenshots().join(format!("{name}.png")), png).unwrap();
}

/// Waits until `check` gives a value, or fails naming `what`.
async fn until<T, F, Fut>(secs: u64, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn text(c: &Client, css: &str) -> Option<String> {
    c.find(Locator::Css(css)).await.ok()?.text().await.ok()
}

async fn attr(c: &Client, css: &str, name: &str) -> Option<String> {
    c.find(Locator::Css(css))
        .await
        .ok()?
        .attr(name)
        .await
        .ok()
        .flatten()
}

async fn enabled(c: &Client, css: &str) -> bool {
    match c.find(Locator::Css(css)).await {
        Ok(e) => e.is_enabled().await.unwrap_or(false),
        Err(_) => false,
    }
}

async fn click(c: &Client, css: &str) {
    c.find(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no {css}: {e}"))
        .click()
        .await
        .unwrap_or_else(|e| panic!("cannot click {css}: {e}"));
}

async fn fill(c: &Client, css: &str, value: &str) {
    let field = c.find(Locator::Css(css)).await.unwrap();
    field.clear().await.unwrap();
    field.send_keys(value).await.unwrap();
}

/// Waits until `css` shows `data-{key}="{value}"`.
async fn until_data(c: &Client, css: &str, key: &str, value: &str, secs: u64) {
    let what = format!("{css} to be {key}={value}");
    until(secs, &what, || async {
        (attr(c, css, &format!("data-{key}")).await.as_deref() == Some(value)).then_some(())
    })
    .await
}

/// Logs in on the page's form with `phone` (dev mode fills the code in).
async fn log_in(c: &Client, phone: &str) {
    until(10, "the login form", || async {
        c.find(Locator::Css("#phone")).await.ok()
    })
    .await;
    fill(c, "#phone", phone).await;
    click(c, "#send-code").await;
    until(10, "the code to be filled in", || async {
        let code = c
            .find(Locator::Css("#code"))
            .await
            .ok()?
            .prop("value")
            .await
            .ok()??;
        (code.len() == 6).then_some(())
    })
    .await;
    click(c, "#login").await;
    until(10, "the logged-in header", || async {
        text(c, "#who")
            .await
            .filter(|t| t.contains(phone))
            .map(|_| ())
    })
    .await;
}

/// An approved sale with these fields (a window, a title, anti-bot...).
async fn create_sale(s: &Server, fields: Value) -> String {
    let (stock, limit) = (
        fields["stock"].as_i64().unwrap(),
        fields["per_user_limit"].as_i64().unwrap(),
    );
    s.api().open_sale_with(stock, limit, &fields).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buyer_waits_for_the_opening_buys_and_pays_a_second_sees_sold_out() {
    let Some(browser) = Browser::start(1100, 1000).await else {
        return;
    };
    let server = Server::embedded(&[]).await;
    let opens_in = 12;
    let sale = create_sale(
        &server,
        json!({
            "title": "Browser test: one lamp", "price_cents": 4999, "stock": 1,
            "per_user_limit": 1, "begins_at": common::rfc3339_in(opens_in),
            "ends_at": common::rfc3339_in(3600), "payment_window_secs": 600,
        }),
    )
    .await;
    let opens_at = Instant::now() + Duration::from_secs(opens_in as u64);
    let base = server.base.clone();
    let sale_id = sale.clone();
    browser
        .run("buyer", move |c| async move {
            c.goto(&format!("{base}/sales/{sale_id}")).await.unwrap();
            until_data(&c, "#state", "state", "upcoming", 10).await;
            let countdown = until(10, "the countdown", || async {
                text(&c, "#countdown").await.filter(|t| t.contains(':'))
            })
            .await;
            let secs: u64 = countdown.rsplit(':').next().unwrap().parse().unwrap();
            assert!(
                (1..=opens_in as u64).contains(&secs),
                "countdown {countdown} for an opening {opens_in} s away"
            );
            assert!(
                !enabled(&c, "#buy").await,
                "buy is enabled before the opening"
            );
            log_in(&c, "+8613900000001").await;
            assert!(
                !enabled(&c, "#buy").await,
                "buy is enabled before the opening"
            );
            shot(&c, "sale-countdown").await;

            until(20, "buy to be enabled at the opening", || async {
                enabled(&c, "#buy").await.then_some(())
            })
            .await;
            let early = opens_at.saturating_duration_since(Instant::now());
            assert!(
                early < Duration::from_millis(400),
                "buy was enabled {early:?} before the opening"
            );
            until_data(&c, "#state", "state", "active", 5).await;
            click(&c, "#buy").await;
            until_data(&c, "#order-status", "status", "pending_payment", 15).await;
            let left = text(&c, "#pay-countdown").await.unwrap_or_default();
            assert!(
                left.starts_with("09:") || left.starts_with("10:"),
                "pay within {left}"
            );
            shot(&c, "sale-bought").await;

            click(&c, "#pay").await;
            until(10, "the pay page", || async {
                let url = c.current_url().await.ok()?;
                url.path().starts_with("/simulated-pay/").then_some(())
            })
            .await;
            until_data(&c, "#pay-status", "status", "created", 10).await;
            assert!(text(&c, "#amount").await.unwrap().contains("49.99"));
            shot(&c, "pay").await;
            click(&c, "#do-pay").await;
            until_data(&c, "#pay-status", "status", "paid", 15).await;

            c.goto(&format!("{base}/orders")).await.unwrap();
            let row = until(10, "the paid order in the list", || async {
                let rows = c.find_all(Locator::Css("tr[data-status]")).await.ok()?;
                rows.into_iter().next()
            })
            .await;
            assert_eq!(
                row.attr("data-status").await.unwrap().as_deref(),
                Some("paid")
            );
            click(&c, "tr[data-status] button").await;
            until(10, "the order's history", || async {
                let steps = c.find_all(Locator::Css("ol.history li")).await.ok()?;
                (steps.len() >= 2).then_some(())
            })
            .await;
            shot(&c, "orders").await;
        })
        .await;

    // SQL holds it paid, as the pages said.
    let stats = server.api().books(&sale, "stats").await.json();
    assert_eq!(stats["orders_by_status"]["paid"], 1, "{stats}");
    assert_eq!(stats["sql_stock"], 0, "{stats}");

    let Some(second) = Browser::start(1100, 900).await else {
        return;
    };
    let base = server.base.clone();
    second
        .run("second-buyer", move |c| async move {
            c.goto(&format!("{base}/sales/{sale}")).await.unwrap();
            log_in(&c, "+8613900000002").await;
            until_data(&c, "#state", "state", "sold_out", 10).await;
            assert!(
                !enabled(&c, "#buy").await,
                "buy is enabled on a sold-out sale"
            );
            assert_eq!(text(&c, "#buy").await.as_deref(), Some("Sold out"));
            shot(&c, "sale-sold-out").await;
            c.goto(&format!("{base}/")).await.unwrap();
            until(10, "the list of sales", || async {
                c.find(Locator::Css(&format!("a[href='/sales/{sale}']")))
                    .await
                    .ok()
            })
            .await;
            shot(&c, "index").await;
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_creates_approves_pauses_and_watches_a_sale_live() {
    let Some(browser) = Browser::start(1200, 1400).await else {
        return;
    };
    let server = Server::embedded(&[]).await;
    let base = server.base.clone();
    let admin = server.admin.clone();
    let title = common::unique("dashboard sale");
    let (sale_tx, sale_rx) = tokio::sync::oneshot::channel::<String>();
    let (bought_tx, bought_rx) = tokio::sync::oneshot::channel::<()>();
    let (paused_tx, paused_rx) = tokio::sync::oneshot::channel::<()>();
    let (checked_tx, checked_rx) = tokio::sync::oneshot::channel::<()>();
    let (keys_tx, keys_rx) = tokio::sync::oneshot::channel::<String>();
    let (keys_checked_tx, keys_checked_rx) = tokio::sync::oneshot::channel::<()>();
    let page_title = title.clone();
    let ui = browser.run("admin", move |c| async move {
        c.goto(&format!("{base}/admin")).await.unwrap();
        fill(&c, "#admin-token", "wrong").await;
        click(&c, "#signin-button").await;
        until(10, "the refusal of a wrong token", || async {
            text(&c, "#message")
                .await
                .filter(|t| t.contains("admin token"))
        })
        .await;
        fill(&c, "#admin-token", &admin).await;
        click(&c, "#signin-button").await;
        until(10, "the dashboard", || async {
            c.find(Locator::Css("#dashboard:not(.hidden)")).await.ok()
        })
        .await;

        // An API key for a dashboard reader, made in the keys panel; its secret shown
        // once, then revoked there.
        fill(&c, "#key-name", "wallboard").await;
        click(&c, "#scope-sales\\:read").await;
        click(&c, "#scope-metrics").await;
        click(&c, "#key-create-button").await;
        let secret = until(10, "the new key's secret", || async {
            let msg = text(&c, "#key-secret").await?;
            msg.split(": ")
                .nth(1)?
                .split(' ')
                .next()
                .map(str::to_string)
        })
        .await;
        assert!(secret.starts_with("sk_"), "{secret}");
        keys_tx.send(secret.clone()).unwrap();
        let key_id = secret.split('_').nth(1).unwrap().to_string();
        let key_row = format!("#key-{key_id}");
        until_data(&c, &key_row, "state", "live", 10).await;
        assert_eq!(
            text(&c, &format!("{key_row} td:nth-child(3)"))
                .await
                .as_deref(),
            Some("sales:read metrics")
        );
        keys_checked_rx.await.unwrap();
        click(&c, &format!("{key_row} button[data-action=revoke]")).await;
        until_data(&c, &key_row, "state", "revoked", 10).await;

        // A new sale through the form: a draft until approved. It opens at once (the
        // form takes local time, to the second).
        fill(&c, "#new-title", &page_title).await;
        fill(&c, "#new-stock", "50").await;
        fill(&c, "#new-limit", "1").await;
        c.execute(
            "const t = new Date(Date.now() - 60000); \
             document.getElementById('new-begins').value = \
             new Date(t.getTime() - t.getTimezoneOffset() * 60000).toISOString().slice(0, 19);",
            vec![],
        )
        .await
        .unwrap();
        click(&c, "#create-button").await;
        let sale = until(10, "the created sale", || async {
            let msg = text(&c, "#message").await?;
            let id = msg.strip_prefix("Sale ")?.split(' ').next()?.to_string();
            Some(id)
        })
        .await;
        let row = format!("#sale-{sale}");
        until_data(&c, &row, "status", "draft", 10).await;
        click(&c, &format!("{row} button[data-action=approve]")).await;
        until_data(&c, &row, "status", "approved", 10).await;
        click(&c, &format!("{row} button[data-action=watch]")).await;
        until(10, "the live view", || async {
            text(&c, "#accepted-total").await.filter(|t| t == "0")
        })
        .await;
        sale_tx.send(sale.clone()).unwrap();

        // Buyers arrive (through the API); the dashboard's count moves.
        bought_rx.await.unwrap();
        until(15, "5 accepted on the dashboard", || async {
            text(&c, "#accepted-total").await.filter(|t| t == "5")
        })
        .await;
        until(15, "5 written on the dashboard", || async {
            text(&c, "#written-total").await.filter(|t| t == "5")
        })
        .await;
        until(10, "the ok answers", || async {
            text(&c, "#answers tr[data-code=ok] td:last-child")
                .await
                .filter(|t| t == "5")
        })
        .await;
        until(15, "the gate reconciled with SQL", || async {
            text(&c, "#reconciled").await.filter(|t| t == "exact")
        })
        .await;
        let p99 = text(&c, "#p99").await.unwrap();
        assert!(!p99.is_empty(), "no p99 shown");
        let points = attr(&c, "#chart polyline", "points").await.unwrap();
        assert!(
            points.split(' ').count() >= 2,
            "chart has no line: {points}"
        );
        shot(&c, "admin").await;

        click(&c, &format!("{row} button[data-action=pause]")).await;
        until_data(&c, &row, "status", "paused", 10).await;
        paused_tx.send(()).unwrap();
        checked_rx.await.unwrap();
        click(&c, &format!("{row} button[data-action=resume]")).await;
        until_data(&c, &row, "status", "approved", 10).await;

        click(&c, "#audit-run").await;
        until(10, "the audit", || async {
            text(&c, "#audit tr[data-field=live_units] td")
                .await
                .filter(|t| t == "5")
        })
        .await;
        assert_eq!(
            text(&c, "#audit tr[data-field=oversold] td")
                .await
                .as_deref(),
            Some("0")
        );
    });

    let buyers = async {
        // The key made in the panel reads sales and metrics, and nothing else.
        let key = keys_rx.await.unwrap();
        let api = server.api();
        assert_eq!(api.get("/api/admin/sales", Some(&key)).await.status, 200);
        assert_eq!(api.get("/metrics", Some(&key)).await.status, 200);
        let refused = api
            .post("/api/admin/sales", Some(&key), Some(&json!({})))
            .await;
        assert_eq!(
            refused.status_code(),
            (403, "forbidden".into()),
            "{refused}"
        );
        keys_checked_tx.send(()).unwrap();
        let sale = sale_rx.await.unwrap();
        let tokens = api.login_users(6).await;
        for t in &tokens[..5] {
            let answer = api.buy(t, &sale).await;
            assert_eq!(answer.status, 200, "{answer}");
        }
        bought_tx.send(()).unwrap();
        paused_rx.await.unwrap();
        // Paused on the dashboard: paused for buyers at once.
        let answer = api.buy(&tokens[5], &sale).await;
        assert_eq!(answer["code"], "paused", "{answer}");
        checked_tx.send(()).unwrap();
        sale
    };
    let ((), sale) = tokio::join!(ui, buyers);
    let audit = server.api().books(&sale, "audit").await.json();
    assert_eq!(audit["live_units"], 5, "{audit}");
    let listed = server.api().admin_sales().await.json();
    assert!(listed.to_string().contains(&title), "{listed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_fit_a_phone_name_their_controls_and_walk_through_the_anti_bot_steps() {
    let Some(browser) = Browser::phone().await else {
        return;
    };
    let server = Server::embedded(&[]).await;
    let token_sale = create_sale(
        &server,
        json!({
            "title": "Token sale", "price_cents": 100, "stock": 10, "per_user_limit": 1,
            "begins_at": common::rfc3339_in(-5), "ends_at": common::rfc3339_in(3600), "anti_bot": "token",
        }),
    )
    .await;
    let captcha_sale = create_sale(
        &server,
        json!({
            "title": "Captcha sale", "price_cents": 100, "stock": 10, "per_user_limit": 1,
            "begins_at": common::rfc3339_in(-5), "ends_at": common::rfc3339_in(3600), "anti_bot": "captcha",
        }),
    )
    .await;
    let base = server.base.clone();
    browser
        .run("phone", move |c| async move {
            for path in ["/", "/orders", "/admin", &format!("/sales/{token_sale}")] {
                c.goto(&format!("{base}{path}")).await.unwrap();
                tokio::time::sleep(Duration::from_millis(500)).await;
                let check = c
                    .execute(
                        "const d = document.documentElement;
                         const unlabelled = [...document.querySelectorAll('input, select')]
                           .filter(e => e.labels.length === 0 && !e.getAttribute('aria-label'))
                           .map(e => e.id);
                         const nameless = [...document.querySelectorAll('button')]
                           .filter(b => !b.textContent.trim() && !b.getAttribute('aria-label')).length;
                         return { overflow: d.scrollWidth - d.clientWidth, unlabelled, nameless,
                                  lang: d.lang };",
                        vec![],
                    )
                    .await
                    .unwrap();
                assert_eq!(check["overflow"], 0, "{path} scrolls sideways on a phone: {check}");
                assert_eq!(check["unlabelled"], json!([]), "{path}: {check}");
                assert_eq!(check["nameless"], 0, "{path}: {check}");
                assert_eq!(check["lang"], "en", "{path}");
                let width = c.execute("return window.innerWidth;", vec![]).await.unwrap();
                assert_eq!(width, 390, "{path}: not laid out as on a phone");
            }
            // A token sale: the page fetches the token itself; the buyer only presses buy.
            log_in(&c, "+8613900000003").await;
            until(10, "buy to be enabled", || async {
                enabled(&c, "#buy").await.then_some(())
            })
            .await;
            shot(&c, "sale-phone").await;
            click(&c, "#buy").await;
            until_data(&c, "#order-status", "status", "pending_payment", 15).await;

            // A captcha sale: pressing buy shows the picture to solve first; a wrong
            // answer is refused and a new picture shown.
            c.goto(&format!("{base}/sales/{captcha_sale}")).await.unwrap();
            until(10, "buy to be enabled", || async {
                enabled(&c, "#buy").await.then_some(())
            })
            .await;
            click(&c, "#buy").await;
            let first = until(10, "a captcha picture", || async {
                attr(&c, "#captcha-image", "src")
                    .await
                    .filter(|s| s.starts_with("data:image/png;base64,"))
            })
            .await;
            fill(&c, "#captcha-answer", "x").await;
            click(&c, "#buy").await;
            until(10, "the wrong answer refused with a new picture", || async {
                let now = attr(&c, "#captcha-image", "src").await?;
                let msg = text(&c, "#message").await?;
                (now != first && !msg.is_empty()).then_some(())
            })
            .await;
            assert!(c.find(Locator::Css("#order:not(.hidden)")).await.is_err());
        })
        .await;
    let stats = server.api().live().await;
    assert_eq!(stats["purchases"]["ok"], 1, "{stats}");
}

#[tokio::test]
async fn pages_and_assets_are_cacheable_and_locked_down() {
    let server = Server::embedded(&[]).await;
    let api = server.api();
    for path in [
        "/",
        "/sales/123",
        "/orders",
        "/simulated-pay/9",
        "/admin",
        "/assets/app.css",
    ] {
        let r = api.get(path, None).await;
        assert_eq!(r.status, 200, "{path}");
        let etag = r.header("etag").unwrap().to_string();
        assert!(r
            .header("cache-control")
            .unwrap()
            .starts_with("public, max-age="));
        assert!(r
            .header("content-security-policy")
            .unwrap()
            .contains("script-src 'self'"));
        let again = Api::send(
            api.request(Method::GET, path)
                .header("If-None-Match", &etag),
        )
        .await;
        assert_eq!(again.status, 304, "{path}");
    }
    for path in ["/sales/abc", "/assets/nothing.js", "/assets/index.html"] {
        let r = api.get(path, None).await;
        assert!((400..500).contains(&r.status), "{path}");
        let body = r.json();
        assert!(body["code"].is_string(), "{path}: {body}");
    }
}

/// The waiting room's page: join before the opening, no place until the draw, a place
/// after it, then the buy button by itself when let through, and the purchase with the pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buyer_joins_the_waiting_room_and_the_page_turns_to_buy_when_let_through() {
    let Some(browser) = Browser::start(1100, 1000).await else {
        return;
    };
    let server = Server::embedded(&[]).await;
    let sale = create_sale(
        &server,
        json!({
            "title": "Browser test: a queued lamp", "price_cents": 2999, "stock": 5,
            "per_user_limit": 1, "begins_at": common::rfc3339_in(20),
            "ends_at": common::rfc3339_in(3600), "payment_window_secs": 600,
            "waiting_room": {"admit_per_sec": 1},
        }),
    )
    .await;
    let base = server.base.clone();
    browser
        .run("waiting room", move |c| async move {
            c.goto(&format!("{base}/sales/{sale}")).await.unwrap();
            log_in(&c, "+8613900000007").await;
            until(10, "the join button", || async {
                enabled(&c, "#join").await.then_some(())
            })
            .await;
            assert!(
                !c.find(Locator::Css("#buy"))
                    .await
                    .unwrap()
                    .is_displayed()
                    .await
                    .unwrap(),
                "no buy button before the room lets the buyer through"
            );
            click(&c, "#join").await;
            until(10, "the lottery's word", || async {
                text(&c, "#room-status")
                    .await
                    .filter(|t| t.contains("lottery"))
            })
            .await;
            shot(&c, "room-joined").await;
            until(40, "the buy button once let through", || async {
                enabled(&c, "#buy").await.then_some(())
            })
            .await;
            shot(&c, "room-admitted").await;
            click(&c, "#buy").await;
            until_data(&c, "#order-status", "status", "pending_payment", 15).await;
        })
        .await;
}
