//! Writes a sheet of captchas (one above the other) to look at: `cargo run --example
//! captcha_sample -- OUT.png`.
use seckill::edge::antibot::captcha::{encode_png, render, HEIGHT, WIDTH};

fn main() {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "captchas.png".into());
    let answers = ["40719", "58236", "11111", "96470", "23058", "77314"];
    let mut sheet = Vec::new();
    for (i, a) in answers.iter().enumerate() {
        let png = render(a, 1000 + i as u64);
        let mut reader = png::Decoder::new(std::io::Cursor::new(png))
            .read_info()
            .unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        reader.next_frame(&mut buf).unwrap();
        sheet.extend_from_slice(&buf[..WIDTH * HEIGHT]);
        sheet.extend(std::iter::repeat_n(255u8, WIDTH * 4));
    }
    let rows = sheet.len() / WIDTH;
    std::fs::write(&out, encode_png(&sheet, WIDTH, rows)).unwrap();
    println!("{}: {}", out, answers.join(" "));
}
