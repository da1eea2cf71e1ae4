//! A well-formed component of the wrong shape: it exports a `greet` function instead of ferry's
//! transport interface, so ferry must refuse it with a message saying so.

wit_bindgen::generate!({
    inline: "
        package test:other;
        world greeter {
            export greet: func(name: string) -> string;
        }
    ",
});

struct Greeter;

impl Guest for Greeter {
    fn greet(name: String) -> String {
        format!("hello {name}")
    }
}

export!(Greeter);
